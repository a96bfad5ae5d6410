"""The in-sandbox code-interpreter service: what ``e2b-code-interpreter`` talks to on port 49999.

Layout (one idea per module):

* ``httpserver`` – a tiny asyncio HTTP/1.1 server (keep-alive, chunked streaming, disconnect signal);
* ``messages``   – pure mapping of Jupyter iopub messages to the NDJSON lines of spec §4;
* ``kernels``    – execution contexts: a ``jupyter_client`` kernel (python) or a subprocess (bash);
* ``service``    – the routes (``/execute``, ``/contexts``, ``/health``) and the envd ``/envs`` lookup;
* ``__main__``   – ``python3 -m aenv_interpreter``: drop to the sandbox user, start, serve.

Why it is self-contained: the template builder (``aenv.images.interpreter``) copies this directory into the
template's overlay layer as the top-level package ``aenv_interpreter``, where it runs under Debian's
``python3`` with only the stdlib and the layer's PyPI packages (``jupyter_client``, ``ipykernel``). So every
import here is relative or stdlib, and ``jupyter_client`` is imported lazily, only by ``kernels``.
"""

from __future__ import annotations

DEFAULT_PORT = 49999
ENVD_PORT = 49983
DEFAULT_CWD = "/home/user"

__all__ = ["DEFAULT_CWD", "DEFAULT_PORT", "ENVD_PORT"]
