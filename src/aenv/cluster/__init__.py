"""aenv on many machines: the processes around the nodes and the gateway.

``redis_proc`` runs a private Redis (the cluster directory, and Ray's GCS store), ``agent`` is the Ray
node agent (one detached actor per node; it starts or adopts that node's ``aenv serve``), ``controller``
the singleton that keeps one agent per node and fences dead nodes in the directory, ``netns`` the
network namespaces of a cluster on one machine, and ``local`` puts them together for
``aenv cluster local``. Ray is imported only inside ``agent``, ``controller`` and ``local``.
"""
