#!/bin/bash
# Run a command "on" a test-cluster node: in the network, UTS and mount namespaces of that
# node's slurmd (so /local-ssd is that node's disk and `hostname` is its name).
# Usage: slurm/cluster/node_exec.sh node2 cat /local-ssd/WHOAMI
set -eu
BASE=${OPGUARD_TEST_CLUSTER:-/tmp/opguard-test-cluster}
node=${1:?usage: node_exec.sh nodeK command...}; shift
pidfile=$BASE/run/ogt-$node.pid
[ -f "$pidfile" ] || { echo "node_exec.sh: error: no node $node (no $pidfile); fix: slurm/cluster/up.sh" >&2; exit 2; }
exec nsenter -t "$(cat "$pidfile")" -n -u -m -- "$@"
