"""The restore's ``--action-script`` as a small static program, where a C compiler is around.

CRIU runs its action script at every one of its seven restore stages and waits for it each time.
The shell form (``criu.ro_remount_action``) costs a ``sh`` at each stage, ``nsenter`` + ``sh`` +
three ``ip`` runs at ``setup-namespaces`` and a ``while read`` over the mount table at
``pre-resume``: measured in a restore log here, 23 ms of an 83 ms restore. Every pool refill and
every fork child is such a restore. This program does the same two jobs with system calls (``setns``,
an ioctl for the loopback, netlink for the stand-in address and route, one read of
``mountinfo``) and exits at once at the other stages.

One binary per source (``criu-action-<digest>``) is built into the root-only actions directory; each
configuration is a symlink to it plus ``<link>.conf``, which the program finds through its own
``argv[0]`` (CRIU runs the script with no arguments). The configuration, one item per line, fields
split by tabs::

    lo_up   ADDR   MARK      setup-namespaces: loopback up; with $CRTOOLS_IMAGE_DIR/MARK, ADDR/32 on lo
                             and a default route through lo (``criu.STAND_IN_ROUTE``)
    fix     ARG0   ARG1 ...  what ``pre-resume`` execs when a bind below lacks a flag (``ro_remount.py``)
    need    POINT  OPTS      a mount point (as ``mountinfo`` escapes it) and its required options
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

from aenv.runtime.tools import build_static

_SOURCE = r"""
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

static char conf[65536], table[1 << 20];

static ssize_t slurp(const char *path, char *buf, size_t cap) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    size_t n = 0;
    for (;;) {
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r < 0) { if (errno == EINTR) continue; close(fd); return -1; }
        if (r == 0 || n + (size_t)r >= cap - 1) { n += (size_t)(r > 0 ? r : 0); break; }
        n += (size_t)r;
    }
    close(fd);
    buf[n] = 0;
    return (ssize_t)n;
}

static int field(char *line, char **out, int max) {  /* split on tabs, in place */
    int n = 0;
    while (n < max) {
        out[n++] = line;
        char *tab = strchr(line, '\t');
        if (!tab) break;
        *tab = 0;
        line = tab + 1;
    }
    return n;
}

static void addattr(struct nlmsghdr *nh, int type, const void *data, int len) {
    struct rtattr *rta = (struct rtattr *)((char *)nh + NLMSG_ALIGN(nh->nlmsg_len));
    rta->rta_type = type;
    rta->rta_len = RTA_LENGTH(len);
    memcpy(RTA_DATA(rta), data, len);
    nh->nlmsg_len = NLMSG_ALIGN(nh->nlmsg_len) + RTA_ALIGN(rta->rta_len);
}

static void begin(struct nlmsghdr *nh, int type, size_t body) {  /* a new, exclusive entry; acked */
    nh->nlmsg_len = NLMSG_LENGTH(body);
    nh->nlmsg_type = type;
    nh->nlmsg_flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
}

static int talk(int sk, struct nlmsghdr *nh) {  /* send one request, read its ack */
    char buf[4096];
    if (send(sk, nh, nh->nlmsg_len, 0) < 0) return -1;
    ssize_t r = recv(sk, buf, sizeof buf, 0);
    if (r < (ssize_t)NLMSG_LENGTH(sizeof(struct nlmsgerr))) return -1;
    struct nlmsghdr *ack = (struct nlmsghdr *)buf;
    if (ack->nlmsg_type != NLMSG_ERROR) return -1;
    int err = ((struct nlmsgerr *)NLMSG_DATA(ack))->error;
    if (err) { errno = -err; return -1; }
    return 0;
}

static int stand_in(const char *addr_text) {  /* ip addr add ADDR/32 dev lo && ip route add default dev lo */
    struct in_addr addr;
    if (inet_pton(AF_INET, addr_text, &addr) != 1) { errno = EINVAL; return -1; }
    int lo = (int)if_nametoindex("lo");
    int sk = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (!lo || sk < 0) return -1;
    struct { struct nlmsghdr nh; union { struct ifaddrmsg ifa; struct rtmsg rt; }; char attrs[64]; } req;
    memset(&req, 0, sizeof req);
    begin(&req.nh, RTM_NEWADDR, sizeof(struct ifaddrmsg));
    req.ifa.ifa_family = AF_INET;
    req.ifa.ifa_prefixlen = 32;
    req.ifa.ifa_index = (unsigned)lo;
    addattr(&req.nh, IFA_LOCAL, &addr, sizeof addr);
    addattr(&req.nh, IFA_ADDRESS, &addr, sizeof addr);
    if (talk(sk, &req.nh) < 0) { close(sk); return -1; }
    memset(&req, 0, sizeof req);
    begin(&req.nh, RTM_NEWROUTE, sizeof(struct rtmsg));
    req.rt.rtm_family = AF_INET;
    req.rt.rtm_table = RT_TABLE_MAIN;
    req.rt.rtm_protocol = RTPROT_BOOT;
    req.rt.rtm_scope = RT_SCOPE_LINK;
    req.rt.rtm_type = RTN_UNICAST;
    addattr(&req.nh, RTA_OIF, &lo, sizeof lo);
    int rc = talk(sk, &req.nh);
    close(sk);
    return rc;
}

static int lo_up(const char *pid, const char *addr, const char *mark) {
    char path[256];
    snprintf(path, sizeof path, "/proc/%s/ns/net", pid);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0 || setns(ns, CLONE_NEWNET) != 0) { perror("aenv criu action: setns"); return 1; }
    close(ns);
    int fd = open("/proc/sys/net/ipv4/ip_nonlocal_bind", O_WRONLY | O_CLOEXEC);  /* opened in the new netns */
    if (fd >= 0) { (void)!write(fd, "1", 1); close(fd); }
    int sk = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (sk < 0 || ioctl(sk, SIOCGIFFLAGS, &ifr) != 0) { perror("aenv criu action: lo"); return 1; }
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(sk, SIOCSIFFLAGS, &ifr) != 0) { perror("aenv criu action: lo up"); return 1; }
    close(sk);
    const char *images = getenv("CRTOOLS_IMAGE_DIR");
    snprintf(path, sizeof path, "%s/%s", images ? images : "/nonexistent", mark);
    if (access(path, F_OK) == 0 && stand_in(addr) != 0) { perror("aenv criu action: stand-in route"); return 1; }
    return 0;
}

static int has_option(const char *opts, const char *want) {  /* ",opts," contains ",want," */
    size_t n = strlen(want);
    for (const char *p = opts; *p; ) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && strncmp(p, want, n) == 0) return 1;
        if (!end) break;
        p = end + 1;
    }
    return 0;
}

static void fix(char **argv) {
    execv(argv[0], argv);
    perror("aenv criu action: exec fix");
    _exit(1);
}

int main(int argc, char **argv) {
    (void)argc;
    const char *action = getenv("CRTOOLS_SCRIPT_ACTION");
    const char *pid = getenv("CRTOOLS_INIT_PID");
    int setup = action && strcmp(action, "setup-namespaces") == 0;
    int resume = action && strcmp(action, "pre-resume") == 0;
    if (!setup && !resume) return 0;
    char path[4096];
    snprintf(path, sizeof path, "%s.conf", argv[0]);
    if (slurp(path, conf, sizeof conf) < 0) { perror("aenv criu action: conf"); return 1; }
    char *needs[256][2], *fixv[64] = {0};
    int n_needs = 0;
    char *lo[3] = {0};
    for (char *line = strtok(conf, "\n"); line; line = strtok(NULL, "\n")) {
        char *f[64];
        int n = field(line, f, 63);
        if (strcmp(f[0], "lo_up") == 0 && n == 3) { lo[0] = f[1]; lo[1] = f[2]; lo[2] = f[0]; }
        else if (strcmp(f[0], "fix") == 0 && n > 1) { for (int i = 1; i < n; i++) fixv[i - 1] = f[i]; }
        else if (strcmp(f[0], "need") == 0 && n == 3 && n_needs < 256) { needs[n_needs][0] = f[1]; needs[n_needs++][1] = f[2]; }
    }
    if (!pid || !fixv[0]) { fprintf(stderr, "aenv criu action: no init pid or no fix\n"); return 1; }
    if (setup) return lo[2] ? lo_up(pid, lo[0], lo[1]) : 0;
    snprintf(path, sizeof path, "/proc/%s/mountinfo", pid);
    if (slurp(path, table, sizeof table) < 0) fix(fixv);
    int seen = 0;
    for (char *line = strtok(table, "\n"); line; line = strtok(NULL, "\n")) {
        char *f[7];
        int n = 0;
        for (char *save = NULL, *tok = strtok_r(line, " ", &save); tok && n < 7; tok = strtok_r(NULL, " ", &save))
            f[n++] = tok;
        if (n < 6) continue;
        for (int i = 0; i < n_needs; i++) {
            if (strcmp(f[4], needs[i][0]) != 0) continue;
            seen = 1;
            char want[256];
            snprintf(want, sizeof want, "%s", needs[i][1]);
            for (char *save = NULL, *o = strtok_r(want, " ", &save); o; o = strtok_r(NULL, " ", &save))
                if (!has_option(f[5], o)) fix(fixv);
        }
    }
    if (!seen) fix(fixv);
    return 0;
}
"""

_DIGEST = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]
_lock = threading.Lock()
_built: dict[Path, bool] = {}


def _escape(point: str) -> str:
    """A mount point as ``mountinfo`` shows it (space, tab, newline and backslash as octal)."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in point)


def conf_text(needs: Sequence[tuple[str, Sequence[str]]], fix: Sequence[str],
              lo_up: tuple[str, str] | None) -> str:
    """The configuration the program reads (see the module docstring)."""
    if any("\t" in a or "\n" in a for a in fix):
        raise ValueError("a fix argument holds a tab or a newline")
    lines = [f"lo_up\t{lo_up[0]}\t{lo_up[1]}"] if lo_up is not None else []
    lines.append("\t".join(("fix", *fix)))
    lines += [f"need\t{_escape(point)}\t{' '.join(opts)}" for point, opts in needs]
    return "\n".join(lines) + "\n"


def _binary(directory: Path) -> Path | None:
    """The compiled program in ``directory``, built once (None: no compiler or static libc here)."""
    exe = directory / f"criu-action-{_DIGEST}"
    with _lock:
        if directory not in _built:
            if not exe.is_file():
                tmp = exe.with_name(f"{exe.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
                if build_static(_SOURCE, tmp):
                    os.replace(tmp, exe)
                else:
                    tmp.unlink(missing_ok=True)
            _built[directory] = exe.is_file()
    return exe if _built[directory] else None


def compiled_action(directory: Path, conf: str) -> Path | None:
    """The path CRIU is given for ``conf``: a symlink to the program beside its ``.conf`` in
    ``directory`` (root-only, checked by the caller), or None where the program cannot be built."""
    exe = _binary(directory)
    if exe is None:
        return None
    link = directory / f"action-{_DIGEST}-{hashlib.sha256(conf.encode()).hexdigest()[:12]}"
    if not link.is_symlink():
        token = f"{os.getpid()}.{secrets.token_hex(4)}"
        conf_tmp = directory / f"{link.name}.conf.{token}.tmp"
        conf_tmp.write_text(conf)
        conf_tmp.chmod(0o600)
        os.replace(conf_tmp, Path(f"{link}.conf"))  # before the link: a link found is a link with its conf
        link_tmp = directory / f"{link.name}.{token}.tmp"
        link_tmp.symlink_to(exe.name)
        os.replace(link_tmp, link)
    return link
