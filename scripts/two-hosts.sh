#!/usr/bin/env bash
# Two hosts on one machine: two network namespaces joined by a veth pair, for multi-node tests.
#
#   scripts/two-hosts.sh up NAME      create namespaces NAME-0 (10.77.0.1) and NAME-1 (10.77.0.2)
#   scripts/two-hosts.sh down NAME    remove them (and the veth pair); succeeds if absent
#   scripts/two-hosts.sh exec NAME N CMD...   run CMD in host N's namespace
#   scripts/two-hosts.sh run NAME -- CMD0 -- CMD1
#                                     create both hosts, run CMD0 on host 0 and CMD1 on host 1
#                                     at once, remove everything afterwards (also on failure or
#                                     interruption); exit with the first non-zero status
#   scripts/two-hosts.sh link NAME up|down    bring the link between the hosts up or down
#   TWO_HOSTS_NAME=NAME scripts/two-hosts.sh agent ADDR CMD...
#                                     Open MPI's remote-shell agent (`--mca plm_rsh_agent
#                                     "bash scripts/two-hosts.sh agent"`): runs the command line
#                                     CMD in the namespace of the host with address ADDR, as ssh
#                                     would on that host; mpirun runs in host 0's namespace
#
# Needs root and iproute2. Each pair of namespaces has its own network stack, so several pairs
# can use the same addresses at once; only the names must differ (NAME: at most 10 characters).
# Nothing is reachable from the namespaces except the other host and each one's loopback.
set -euo pipefail

ADDR0=10.77.0.1
ADDR1=10.77.0.2

die() { echo "two-hosts: $*" >&2; exit 2; }

check() {
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
    command -v ip >/dev/null 2>&1 || die "needs iproute2's ip"
    [ -n "${1:-}" ] || die "no NAME given"
    [ "${#1}" -le 10 ] || die "NAME '$1' is longer than 10 characters"
    case "$1" in *[!A-Za-z0-9_]*) die "NAME '$1' may hold only letters, digits and _";; esac
}

up() {
    local n=$1
    down "$n"
    ip netns add "$n-0"
    ip netns add "$n-1"
    ip link add "$n-v0" type veth peer name "$n-v1"
    ip link set "$n-v0" netns "$n-0"
    ip link set "$n-v1" netns "$n-1"
    ip -n "$n-0" addr add "$ADDR0/24" dev "$n-v0"
    ip -n "$n-1" addr add "$ADDR1/24" dev "$n-v1"
    for h in 0 1; do
        ip -n "$n-$h" link set lo up
        ip -n "$n-$h" link set "$n-v$h" up
    done
}

down() {
    local n=$1
    ip netns del "$n-0" 2>/dev/null || true
    ip netns del "$n-1" 2>/dev/null || true
    # Deleting a namespace deletes the veth end in it and so the pair; an end still in the root
    # namespace (a failed `up`) is removed here.
    ip link del "$n-v0" 2>/dev/null || true
    ip link del "$n-v1" 2>/dev/null || true
}

link() {
    local n=$1 state=$2
    case "$state" in up|down) ;; *) die "link state must be up or down, not '$state'";; esac
    ip -n "$n-0" link set "$n-v0" "$state"
}

cmd=${1:-}; shift || true
case "$cmd" in
    up) check "${1:-}"; up "$1"; echo "host 0: $ADDR0 (netns $1-0), host 1: $ADDR1 (netns $1-1)";;
    down) check "${1:-}"; down "$1";;
    link) check "${1:-}"; link "$1" "${2:-}";;
    exec)
        check "${1:-}"; n=$1; h=${2:-}; shift 2 || die "exec NAME N CMD..."
        case "$h" in 0|1) ;; *) die "host must be 0 or 1, not '$h'";; esac
        exec ip netns exec "$n-$h" "$@";;
    run)
        check "${1:-}"; n=$1; shift
        [ "${1:-}" = "--" ] || die "run NAME -- CMD0 -- CMD1"
        shift
        cmd0=(); while [ $# -gt 0 ] && [ "$1" != "--" ]; do cmd0+=("$1"); shift; done
        [ "${1:-}" = "--" ] || die "run NAME -- CMD0 -- CMD1"
        shift; cmd1=("$@")
        [ ${#cmd0[@]} -gt 0 ] && [ ${#cmd1[@]} -gt 0 ] || die "run NAME -- CMD0 -- CMD1"
        trap 'down "$n"' EXIT
        trap 'exit 130' INT TERM
        up "$n"
        ip netns exec "$n-0" "${cmd0[@]}" & p0=$!
        ip netns exec "$n-1" "${cmd1[@]}" & p1=$!
        s0=0; s1=0
        wait "$p0" || s0=$?
        wait "$p1" || s1=$?
        echo "two-hosts: host 0 exited with $s0, host 1 with $s1" >&2
        [ "$s0" != 0 ] && exit "$s0"
        exit "$s1";;
    agent)
        n=${TWO_HOSTS_NAME:-}; check "$n"; addr=${1:-}; shift || true
        case "$addr" in
            "$ADDR0") h=0;; "$ADDR1") h=1;;
            *) die "agent: unknown host '$addr' (the hosts are $ADDR0 and $ADDR1)";;
        esac
        # Like ssh: the remote command is one line for the remote shell.
        exec ip netns exec "$n-$h" sh -c "$*";;
    *) die "usage: two-hosts.sh up|down|link|exec|run|agent NAME ...";;
esac
