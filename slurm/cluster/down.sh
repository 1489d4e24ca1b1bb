#!/bin/bash
# Tear down what up.sh started, leaving no process, namespace, bridge, mount or route behind:
# SIGKILL every process in the cluster's network namespaces (daemons, slurmstepd, job tasks,
# orphans - repeated until none is left), stop our munged, delete the namespaces, the bridge,
# the guard route, the /local-ssd mount point (if up.sh created it) and /run/netns's mount (if
# up.sh's `ip netns add` created it). Then it checks, and exits 1 naming whatever is left.
# Cluster state is thrown away (up.sh starts fresh); logs stay in $BASE/log for post-mortems.
# Usage: slurm/cluster/down.sh      (env: OPGUARD_TEST_CLUSTER = base dir)
set -u
BASE=${OPGUARD_TEST_CLUSTER:-/tmp/opguard-test-cluster}
NET=10.213.0
BR=ogtbr0
[ "$(id -u)" = 0 ] || { echo "down.sh: error: must run as root" >&2; exit 1; }
our_ns() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^ogt-(ctl|node[0-9]+)$'; }

for _ in $(seq 50); do
  pids=$(for ns in $(our_ns); do ip netns pids "$ns" 2>/dev/null; done)
  [ -z "$pids" ] && break
  kill -KILL $pids 2>/dev/null
  sleep 0.02
done
if [ -f "$BASE/run/munged.pid" ]; then
  p=$(cat "$BASE/run/munged.pid")
  kill -TERM "$p" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.02; done
  kill -KILL "$p" 2>/dev/null
  rm -f "$BASE/run/munged.pid"
fi
for ns in $(our_ns); do ip netns del "$ns" 2>/dev/null; done
ip link del "$BR" 2>/dev/null
while ip route del unreachable ${NET}.0/24 metric 4000 2>/dev/null; do :; done
if [ -f "$BASE/run/local-ssd-created" ]; then rmdir /local-ssd 2>/dev/null && rm -f "$BASE/run/local-ssd-created"; fi
if [ -f "$BASE/run/netns-mount-created" ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ]; then
  for _ in $(seq 50); do mountpoint -q /run/netns || break; umount /run/netns 2>/dev/null || sleep 0.02; done
  mountpoint -q /run/netns || { rmdir /run/netns 2>/dev/null; rm -f "$BASE/run/netns-mount-created"; }
fi
rm -f "$BASE"/run/*.pid
# proctrack/cgroup: the per-node cgroup trees slurmd made (empty once their processes are gone)
if [ -n "$(ls -d /sys/fs/cgroup/*/slurm_node[0-9]* 2>/dev/null)" ]; then
  for _ in $(seq 50); do
    find /sys/fs/cgroup/*/slurm_node[0-9]* -depth -type d -exec rmdir {} + 2>/dev/null
    [ -z "$(ls -d /sys/fs/cgroup/*/slurm_node[0-9]* 2>/dev/null)" ] && break; sleep 0.02
  done
fi

# ---------- verify ----------
left=()
[ -z "$(our_ns)" ] || left+=("namespaces: $(our_ns | tr '\n' ' ')")
ip link show "$BR" >/dev/null 2>&1 && left+=("bridge $BR")
ip route show | grep -q "^unreachable ${NET}.0/24" && left+=("route unreachable ${NET}.0/24")
ip route show | grep -q "${NET}.0/24 dev" && left+=("route ${NET}.0/24")
grep -qE " /local-ssd | /run/netns/ogt-" /proc/self/mountinfo && left+=("mounts: $(grep -E ' /local-ssd | /run/netns/ogt-' /proc/self/mountinfo | awk '{print $5}' | tr '\n' ' ')")
[ -z "$(ls -d /sys/fs/cgroup/*/slurm_node[0-9]* 2>/dev/null)" ] || left+=("cgroups: $(ls -d /sys/fs/cgroup/*/slurm_node[0-9]* | tr '\n' ' ')")
[ -f "$BASE/run/netns-mount-created" ] && left+=("mount /run/netns")
[ -f "$BASE/run/local-ssd-created" ] && left+=("directory /local-ssd")
if [ -s "$BASE/run/netns-inodes" ]; then   # any process still living in one of our (deleted) namespaces
  inodes=" $(tr '\n' ' ' < "$BASE/run/netns-inodes")"
  for f in /proc/[0-9]*/ns/net; do
    l=$(readlink "$f" 2>/dev/null) || continue; i=${l#net:[}; i=${i%]}
    case "$inodes" in *" $i "*) p=${f#/proc/}; left+=("process ${p%%/*} in a cluster namespace");; esac
  done
  [ ${#left[@]} -gt 0 ] || rm -f "$BASE/run/netns-inodes"
fi
procs=$(pgrep -f "$BASE/etc/slurm.conf|$BASE/etc/munge.key" 2>/dev/null | tr '\n' ' ')
[ -z "$procs" ] || left+=("processes: $procs")
if [ ${#left[@]} -gt 0 ]; then
  printf 'down.sh: error: left behind: %s\n' "${left[@]}" >&2
  exit 1
fi
echo "down: nothing left behind" >&2
