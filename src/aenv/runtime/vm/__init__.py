"""The ``vm`` runtime: QEMU ``-M microvm`` sandboxes that start by snapshot restore.

Layers, bottom up (each module has one job; nothing here imports the heavy parts eagerly):

* ``qmp/``        self-contained asyncio QMP client
* ``config``      :class:`VmConfig`, the immutable description of one QEMU process
* ``cmdline``     pure ``VmConfig`` → argv builder
* ``accel``       TCG/KVM choice with the reason (``aenv doctor``)
* ``kernel``      guest kernel from Debian's ``linux-source-6.1`` (``python -m aenv.runtime.vm.kernel build``)
* ``initramfs``   busybox ``/init`` that mounts root + tools and switch_roots to the agent
* ``disk``        ext4 images, qcow2 bases and overlays
* ``artifacts``   kernel + initramfs + tools image, found or built once
* ``machine``     one running QEMU: spawn/attach, pause, snapshot, restore, ordered kill
* ``sandbox``     a machine + its run dir + the mux session to the guest agent
* ``template``    boot once, wait for envd, snapshot (templates are snapshots)
* ``pool``        pre-restored sandboxes per template
* ``runtime``     :class:`VmRuntime`, the Runtime protocol front door
"""
