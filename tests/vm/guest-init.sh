#!/bin/sh
# PID 1 of a test guest, on the read-only shared root: writable tmpfs where containerd, runc
# and the tests write, cgroup v1 hierarchies as on the CI host (or the v2 one when the kernel
# command line says cpushim.cgroup=2), then the scenarios under pytest
# (tests/vm/guest_runner.py), whose results land in /mnt/results. With cpushim.init=systemd
# it hands PID 1 over to systemd instead, which mounts the cgroup hierarchy itself and runs
# the scenarios as a service (this script again, with the argument "scenarios"), as kubelet,
# containerd and runc meet systemd on a production node. Whatever happens, the guest ends
# with a reboot, which QEMU (-no-reboot) turns into its exit.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=/mnt/payload/site:/mnt/payload/src:/mnt/deps

run_scenarios() {
    cd /mnt/payload/src || return
    python3 -m tests.vm.guest_runner /mnt/results > /dev/console 2>&1
    echo "$?" > /mnt/results/exit-code
    sync
    echo "guest-init: done at $(cut -d' ' -f1 /proc/uptime) s" > /dev/console
}

if [ "$1" = scenarios ]; then
    # systemd's cpushim-guest.service (below); its SuccessAction and FailureAction reboot.
    run_scenarios
    exit 0
fi

mount -t proc proc /proc
mount -t sysfs sysfs /sys
echo "guest-init: userspace at $(cut -d' ' -f1 /proc/uptime) s" > /dev/console
for dir in /run /tmp /root /var/lib /var/log /dev/shm; do
    mkdir -p "$dir" 2>/dev/null
    mount -t tmpfs -o mode=0755 tmpfs "$dir"
done
chmod 1777 /tmp /dev/shm
mkdir -p /dev/pts && mount -t devpts devpts /dev/pts
busybox ip link set lo up
hostname cpushim-vm

if grep -qw 'cpushim.init=systemd' /proc/cmdline; then
    # Runtime units (/run/systemd/system is on the tmpfs just mounted): a target holding
    # nothing but the scenarios' service, so systemd starts no more than runc needs of it
    # (PID 1's private bus, /run/systemd/private, for transient scopes and slices).
    units=/run/systemd/system
    mkdir -p "$units"
    cat > "$units/cpushim-guest.target" <<'UNIT'
[Unit]
Description=cpushim's VM scenarios
Wants=cpushim-guest.service
AllowIsolate=yes
UNIT
    cat > "$units/cpushim-guest.service" <<'UNIT'
[Unit]
Description=cpushim's VM scenarios under pytest
DefaultDependencies=no
SuccessAction=reboot-immediate
FailureAction=reboot-immediate

[Service]
Type=oneshot
TimeoutStartSec=infinity
StandardOutput=tty
StandardError=inherit
TTYPath=/dev/console
ExecStart=/bin/sh /mnt/payload/guest-init.sh scenarios
UNIT
    if [ ! -x /lib/systemd/systemd ]; then
        # A failed exec would end PID 1 in a panic; say why first.
        echo "guest-init: no /lib/systemd/systemd in the root" > /dev/console
        echo b > /proc/sysrq-trigger
    fi
    exec /lib/systemd/systemd --unit=cpushim-guest.target
fi

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
run_scenarios
echo b > /proc/sysrq-trigger
