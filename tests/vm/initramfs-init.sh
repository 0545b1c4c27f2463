#!/bin/busybox sh
# PID 1 of the initramfs: load the virtio and 9p modules, mount the shared root (read-only)
# and the session's directories over virtio-9p, and hand over to the payload's guest-init.sh.
# Any failure reboots, which ends QEMU (-no-reboot): the host then reports the console.
bb=/bin/busybox
fail() {
    echo "initramfs: $*"
    $bb sync
    $bb reboot -f
}
$bb mkdir -p /proc /dev /newroot
$bb mount -t proc proc /proc
$bb mount -t devtmpfs devtmpfs /dev
for module in $($bb cat /modules/order); do
    $bb insmod "/modules/$module.ko" || fail "insmod $module failed"
done
ninep="trans=virtio,version=9p2000.L,msize=262144"
# The read-only shares never change while a guest runs, so the guest may cache them
# (cache=loose): every uncached lookup is a round trip through the emulated virtio device.
cached="$ninep,ro,cache=loose"
$bb mount -t 9p -o "$cached" root /newroot || fail "cannot mount the root (tag root)"
$bb mount -t 9p -o "$cached" deps /newroot/mnt/deps || fail "cannot mount tag deps"
$bb mount -t 9p -o "$cached" payload /newroot/mnt/payload || fail "cannot mount tag payload"
$bb mount -t 9p -o "$ninep" results /newroot/mnt/results || fail "cannot mount tag results"
$bb umount /proc
$bb mount --move /dev /newroot/dev
exec $bb switch_root /newroot /bin/sh /mnt/payload/guest-init.sh
