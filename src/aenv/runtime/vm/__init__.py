"""The ``vm`` runtime: QEMU ``-M microvm`` sandboxes that start by snapshot restore.

Layers, bottom up (each module has one job; nothing here imports the heavy parts eagerly):

* ``qmp/``        self-contained asyncio QMP client
* ``config``      :class:`VmConfig`, the immutable description of one QEMU process
* ``cmdline``     pure ``VmConfig`` → argv builder
* ``accel``       TCG/KVM choice with the reason (``aenv doctor``)
* ``kernel``      guest kernel from Debian's ``linux-source-6.1`` (``python -m aenv.runtime.vm.kernel build``)
* ``initramfs``   busybox ``/init`` that mounts root + tools and switch_roots to the agent
* ``disk``        ext4 images, qcow2 bases and overlays
* ``frozen``      the ramfs store of template RAM (no hole punches); sparse copies and links of RAM files
* ``artifacts``   kernel + initramfs + tools image, found or built once
* ``machine``     one running QEMU: spawn/attach, pause, snapshot, restore, ordered kill
* ``sandbox``     a machine + its run dir + the mux session to the guest agent (envd through
                  ``aenv.runtime.envd_client``, shared with the ns runtime)
* ``errors``      QEMU, disk and layer failures translated into aenv's errors, in one place
* ``template``    boot once, wait for envd, snapshot (templates are snapshots); the template cache
* ``pool``        pre-restored sandboxes per template
* ``table``       which sandboxes exist: running and released ones, their specs and locks
* ``release``     pause to disk: after an idle while or under memory pressure (``pressure``: the policy)
* ``snapshot``    layered and stream snapshots, restore, fork, rollback
* ``reconcile``   after a restart: adopt what is left running, remove what nobody owns
* ``runtime``     :class:`VmRuntime`, the Runtime protocol front door
"""
