"""Lazy (on-demand) images: a template's read-only root filesystem, fetched chunk by chunk when read.

``format`` (chunks + index), ``publish`` (registry artifact or directory store), ``chunkcache`` (the
node's bounded cache), ``reader`` (single-flight, checked fetches), ``daemon`` (the FUSE front-end,
its own process), ``lazyd`` (the server's handle on that process: start, register, stats, pin).
"""
