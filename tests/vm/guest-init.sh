#!/bin/sh
# PID 1 of a test guest, on the read-only shared root: writable tmpfs where containerd, runc
# and the tests write, cgroup v1 hierarchies as on the CI host (or the v2 one when the kernel
# command line says cpushim.cgroup=2), then the scenarios under
# pytest (tests/vm/guest_runner.py), whose results land in /mnt/results. Whatever happens,
# the guest ends with a reboot, which QEMU (-no-reboot) turns into its exit.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=/mnt/payload/site:/mnt/payload/src:/mnt/deps

mount -t proc proc /proc
mount -t sysfs sysfs /sys
echo "guest-init: userspace at $(cut -d' ' -f1 /proc/uptime) s" > /dev/console
for dir in /run /tmp /root /var/lib /var/log /dev/shm; do
    mkdir -p "$dir" 2>/dev/null
    mount -t tmpfs -o mode=0755 tmpfs "$dir"
done
chmod 1777 /tmp /dev/shm
mkdir -p /dev/pts && mount -t devpts devpts /dev/pts
if grep -qw 'cpushim.cgroup=2' /proc/cmdline; then
    # The unified hierarchy, its controllers open to the cgroups runc makes below the root.
    mount -t cgroup2 cgroup2 /sys/fs/cgroup
    echo "+cpuset +cpu +memory +pids" > /sys/fs/cgroup/cgroup.subtree_control
else
    mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup
    for controllers in cpuset cpu,cpuacct memory pids devices freezer blkio hugetlb \
            perf_event net_cls,net_prio; do
        mkdir -p "/sys/fs/cgroup/$controllers"
        mount -t cgroup -o "$controllers" cgroup "/sys/fs/cgroup/$controllers"
    done
    ln -s cpu,cpuacct /sys/fs/cgroup/cpu
    ln -s cpu,cpuacct /sys/fs/cgroup/cpuacct
    ln -s net_cls,net_prio /sys/fs/cgroup/net_cls
    ln -s net_cls,net_prio /sys/fs/cgroup/net_prio
fi
busybox ip link set lo up
hostname cpushim-vm

cd /mnt/payload/src
python3 -m tests.vm.guest_runner /mnt/results > /dev/console 2>&1
echo "$?" > /mnt/results/exit-code
sync
echo "guest-init: done at $(cut -d' ' -f1 /proc/uptime) s" > /dev/console
echo b > /proc/sysrq-trigger
