#!/bin/bash
# Bring up a real multi-node Slurm cluster on ONE Linux machine, for opguard's tests and CI.
#
#   munged     root network namespace, private socket $BASE/run/munge/munge.socket (AuthInfo)
#   slurmctld  netns ogt-ctl    hostname slurmctl  10.213.0.1
#   slurmd     netns ogt-nodeK  hostname nodeK     10.213.0.(10+K)   K = 1..N
#
# Every daemon runs in its own network, UTS and mount namespace; the veths hang off the bridge
# ogtbr0 (10.213.0.254 in the root namespace, so sbatch/srun/squeue work from outside). Each node
# bind-mounts its own directory $BASE/nodes/nodeK/local-ssd on /local-ssd: node-local, invisible
# to the other nodes. Everything else (e.g. $BASE/shared) is the one shared filesystem.
# A guard route `unreachable 10.213.0.0/24 metric 4000` keeps test traffic off the default route
# if the bridge ever disappears. Only the 10.213.0.0/24 test subnet is used.
#
# Needs root and the Debian packages slurm-wlm + munge (see .ci/run). Runs down.sh first, so a
# cluster left behind by a killed run never gets in the way.
#
# Usage: slurm/cluster/up.sh [N]      (N nodes, default 3; env: OPGUARD_TEST_CLUSTER = base dir,
#        KILLWAIT = Slurm's KillWait seconds, default 10; PROCTRACK = linuxproc (default) or cgroup:
#        proctrack/cgroup, the common production setting, on the cgroup v1 freezer hierarchy)
# Then:  export SLURM_CONF=$BASE/etc/slurm.conf     (printed on the last line)
# Stop:  slurm/cluster/down.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
N=${1:-${N:-3}}
BASE=${OPGUARD_TEST_CLUSTER:-/tmp/opguard-test-cluster}
NET=10.213.0
BR=ogtbr0
KILLWAIT=${KILLWAIT:-10}
PROCTRACK=${PROCTRACK:-linuxproc}
T0=$(date +%s%N)
log() { echo "[up $(( ($(date +%s%N) - T0) / 1000000 )) ms] $*" >&2; }
die() { echo "up.sh: error: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (network, UTS and mount namespaces); fix: run as root or skip the Slurm tests"
for b in slurmctld slurmd munged munge ip nsenter unshare setpriv scontrol sinfo; do
  command -v "$b" >/dev/null || die "missing $b; fix: apt-get install -y --no-install-recommends slurm-wlm munge iproute2 util-linux"
done
case "$N" in ''|*[!0-9]*) die "N=$N is not a node count; fix: pass 1..9";; esac
[ "$N" -ge 1 ] && [ "$N" -le 9 ] || die "N=$N out of range; fix: pass 1..9"
case "$PROCTRACK" in
  linuxproc) ;;
  cgroup) [ -d /sys/fs/cgroup/freezer ] || die "PROCTRACK=cgroup needs the cgroup v1 freezer hierarchy at /sys/fs/cgroup/freezer";;
  *) die "PROCTRACK=$PROCTRACK; fix: linuxproc or cgroup";;
esac
case "$BASE" in /*) ;; *) die "OPGUARD_TEST_CLUSTER=$BASE is not absolute";; esac

"$HERE/down.sh" >/dev/null 2>&1 || true     # whatever a killed run left behind
trap 'rc=$?; [ $rc = 0 ] || { echo "up.sh failed (rc $rc); tearing down" >&2; "$HERE/down.sh" >&2; }' EXIT

rm -rf "$BASE"/{state,spool,log,run,nodes}      # fresh cluster state every time (job ids restart at 1)
mkdir -p "$BASE"/{etc,state,spool,log,run/munge,shared,nodes}
chmod 755 "$BASE" "$BASE"/etc "$BASE"/run "$BASE"/spool "$BASE"/shared
echo "$N" > "$BASE/run/nodes"

# ---------- network ----------
mountpoint -q /run/netns 2>/dev/null || touch "$BASE/run/netns-mount-created"   # `ip netns add` mounts it
ip route replace unreachable ${NET}.0/24 metric 4000
ip link add "$BR" type bridge
ip addr add ${NET}.254/24 dev "$BR"
ip link set "$BR" up
declare -A IP
IP[ogt-ctl]=${NET}.1
for k in $(seq 1 "$N"); do IP[ogt-node$k]=${NET}.$((10 + k)); done
for ns in ogt-ctl $(seq -f 'ogt-node%g' 1 "$N"); do
  ip netns add "$ns"
  ip link add "v-$ns" type veth peer name eth0 netns "$ns"
  ip link set "v-$ns" master "$BR" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "${IP[$ns]}/24" dev eth0
  ip -n "$ns" link set eth0 up
done
for ns in ogt-ctl $(seq -f 'ogt-node%g' 1 "$N"); do stat -L -c %i "/run/netns/$ns"; done > "$BASE/run/netns-inodes"
ip route get ${NET}.1 | grep -q "dev $BR" || die "route to ${NET}.1 does not go through $BR"
log "network up"

{
  echo "127.0.0.1 localhost"
  echo "${NET}.254 $(hostname -s) rootns"
  echo "${NET}.1 slurmctl"
  for k in $(seq 1 "$N"); do echo "${NET}.$((10 + k)) node$k"; done
} > "$BASE/etc/hosts"

# ---------- munge: our own daemon, key and socket (never the system's) ----------
MSOCK=$BASE/run/munge/munge.socket
[ -f "$BASE/etc/munge.key" ] || { dd if=/dev/urandom of="$BASE/etc/munge.key" bs=1024 count=1 status=none; }
chown munge:munge "$BASE/etc/munge.key" "$BASE/run/munge"; chmod 400 "$BASE/etc/munge.key"; chmod 755 "$BASE/run/munge"
setsid setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground \
  --socket="$MSOCK" --key-file="$BASE/etc/munge.key" --pid-file="$BASE/run/munge/munged.pid" \
  --seed-file="$BASE/run/munge/munged.seed" --log-file="$BASE/log/munged.log" \
  > "$BASE/log/munged.out" 2>&1 < /dev/null &
echo $! > "$BASE/run/munged.pid"
for _ in $(seq 100); do [ -S "$MSOCK" ] && break; sleep 0.02; done
munge -S "$MSOCK" -n | unmunge -S "$MSOCK" > /dev/null || { cat "$BASE/log/munged.out" >&2; die "munged does not answer on $MSOCK"; }
log "munged up"

# ---------- slurm.conf ----------
cat > "$BASE/etc/slurm.conf" <<CONF
ClusterName=opguardtest
SlurmctldHost=slurmctl(${NET}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MSOCK
StateSaveLocation=$BASE/state
SlurmdSpoolDir=$BASE/spool/%n
SlurmctldPidFile=$BASE/run/slurmctld.pid
SlurmdPidFile=$BASE/run/slurmd-%n.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/$PROCTRACK
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=$KILLWAIT
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
MailProg=/bin/true
CONF
if [ "$PROCTRACK" = cgroup ]; then   # each slurmd makes /sys/fs/cgroup/<ss>/slurm_<node>/...; down.sh removes them
  printf 'CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nCgroupAutomount=no\nConstrainCores=no\nConstrainRAMSpace=no\nConstrainDevices=no\n' > "$BASE/etc/cgroup.conf"
else
  rm -f "$BASE/etc/cgroup.conf"
fi
echo "$PROCTRACK" > "$BASE/run/proctrack"
for k in $(seq 1 "$N"); do
  echo "NodeName=node$k NodeAddr=${NET}.$((10 + k)) CPUs=4 RealMemory=2000 State=UNKNOWN" >> "$BASE/etc/slurm.conf"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$BASE/etc/slurm.conf"
export SLURM_CONF=$BASE/etc/slurm.conf

# ---------- daemons, each in its netns + a new UTS and mount namespace ----------
mkdir -p /local-ssd 2>/dev/null && [ -d /local-ssd ] || die "cannot create the mount point /local-ssd"
[ -e "$BASE/run/local-ssd-created" ] || { [ -z "$(ls -A /local-ssd)" ] && touch "$BASE/run/local-ssd-created"; }
setsid nsenter --net=/run/netns/ogt-ctl unshare --uts --mount --propagation private \
  /bin/sh -c 'hostname slurmctl; mount --bind "$0" /etc/hosts; exec /usr/sbin/slurmctld -D -i -f "$1"' \
  "$BASE/etc/hosts" "$SLURM_CONF" > "$BASE/log/ogt-ctl.out" 2>&1 < /dev/null &
echo $! > "$BASE/run/ogt-ctl.pid"
for k in $(seq 1 "$N"); do
  mkdir -p "$BASE/spool/node$k" "$BASE/nodes/node$k/local-ssd"
  echo "node$k" > "$BASE/nodes/node$k/local-ssd/WHOAMI"
  setsid nsenter --net=/run/netns/ogt-node$k unshare --uts --mount --propagation private \
    /bin/sh -c 'hostname "$0"; mount --bind "$1" /etc/hosts; mount --bind "$2" /local-ssd; exec /usr/sbin/slurmd -D -f "$3"' \
    "node$k" "$BASE/etc/hosts" "$BASE/nodes/node$k/local-ssd" "$SLURM_CONF" \
    > "$BASE/log/ogt-node$k.out" 2>&1 < /dev/null &
  echo $! > "$BASE/run/ogt-node$k.pid"
done

for _ in $(seq 500); do
  kill -0 "$(cat "$BASE/run/ogt-ctl.pid")" 2>/dev/null || { cat "$BASE/log/ogt-ctl.out" "$BASE/log/slurmctld.log" >&2; die "slurmctld died"; }
  scontrol ping 2>/dev/null | grep -q UP && break
  sleep 0.02
done
log "slurmctld answers"
idle=0
for _ in $(seq 1000); do
  idle=$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$' || true)
  [ "$idle" = "$N" ] && break
  sleep 0.02
done
[ "$idle" = "$N" ] || { sinfo -N -l >&2; die "only $idle of $N nodes idle"; }
log "cluster up: $N nodes idle"
echo "export SLURM_CONF=$SLURM_CONF"
