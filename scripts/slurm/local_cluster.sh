#!/usr/bin/env bash
# A one-node SLURM cluster on this machine (tests, CI, trying the sbatch scripts), with job accounting: munged,
# MariaDB, slurmdbd, slurmctld and slurmd started directly as root (no systemd, no cgroups), their config, state
# and logs in one folder, ${PYRAMIDKV_SLURM_DIR:-/tmp/pyramidkv-slurm}.
#   scripts/slurm/local_cluster.sh install  # Debian's packages (apt-get, as root); their services left stopped
#   scripts/slurm/local_cluster.sh start    # waits until the node is idle; else names the daemon and its log
#   scripts/slurm/local_cluster.sh status
#   scripts/slurm/local_cluster.sh stop     # cancels its jobs, stops the daemons start started
# Then: export SLURM_CONF=${PYRAMIDKV_SLURM_DIR:-/tmp/pyramidkv-slurm}/slurm.conf; sbatch ...; sacct ...
set -euo pipefail
DIR=${PYRAMIDKV_SLURM_DIR:-/tmp/pyramidkv-slurm}
WAIT_S=${PYRAMIDKV_SLURM_WAIT_S:-60}
PORT=${PYRAMIDKV_SLURM_PORT:-6817}   # slurmctld; slurmd, slurmdbd and MariaDB take the next three
export SLURM_CONF=$DIR/slurm.conf
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)   # in start order
PACKAGES="slurm-wlm slurmdbd munge mariadb-server-core mariadb-client-core"   # Debian bookworm: Slurm 22.05

say() { echo "local_cluster.sh: $*"; }

pid_of() {   # the pid of a daemon this script started, if it still runs (a zombie or a reused pid is not it)
  local pid stat
  pid=$(cat "$DIR/run/$1.pid" 2>/dev/null) && [ -n "$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat:0:1}" != Z ] && echo "$pid"
}

launch() {   # launch NAME COMMAND...: the daemon in the foreground of its own session, its pid kept at once
  local name=$1; shift
  setsid "$@" </dev/null >>"$DIR/log/$name.log" 2>&1 9>&- &   # 9: the lock, not theirs to hold
  local pid=$!
  echo "$pid" > "$DIR/run/$name.pid"
  for _ in $(seq 50); do   # until setsid has become the daemon (pid_of checks the name), or has died
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != "$name" ] && kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
}

fail() {   # fail DAEMON WHAT: one line naming the daemon and its log, then the log's tail; stops the others
  local log=$DIR/log/$1.log tail
  say "error: $1 $2 (log $log)" >&2
  # A Slurm daemon in the foreground writes its messages twice, to its log file and ("$1: ...") to stderr: once
  # here, unless it died before it opened the file.
  tail=$(grep -v "^$1: " "$log" 2>/dev/null | tail -n 12) || true
  [ -n "$tail" ] || tail=$(tail -n 12 "$log" 2>/dev/null) || true
  echo "$tail" | sed 's/^/  /' >&2
  stop >/dev/null 2>&1 || true
  exit 1
}

wait_for() {   # wait_for DAEMON WHAT COMMAND...: until COMMAND succeeds, DAEMON dies or the deadline passes
  local daemon=$1 what=$2; shift 2
  until "$@" >/dev/null 2>&1; do
    pid_of "$daemon" >/dev/null || fail "$daemon" "exited before $what"
    [ "$SECONDS" -lt "$DEADLINE" ] || fail "$daemon" "runs but is not $what after ${WAIT_S}s"
    sleep 0.3
  done
}

write_config() {   # slurm.conf, slurmdbd.conf and the munge key; CPUs and memory read from this machine
  local host cpus mem
  host=$(hostname -s)
  cpus=$(nproc)                                              # what this container may use, not the host's cores
  mem=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 * 9 / 10 ))
  rm -rf "$DIR/log.prev"
  if [ -d "$DIR/log" ]; then mv "$DIR/log" "$DIR/log.prev"; fi   # the logs of this start alone; the last kept
  mkdir -p "$DIR"/{run,log,state,spool,munge,mysql}
  if [ ! -s "$DIR/munge/munge.key" ]; then
    head -c 1024 /dev/urandom > "$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
  fi
  # AccountingStoragePass: the munge socket slurmctld and the clients reach slurmdbd through (AuthInfo's is not
  # used for it). MinJobAge=5: a finished job leaves slurmctld after 5 s (sacct keeps it), so sbatch --wait polls
  # every 2 s rather than backing off to 32 s.
  cat > "$DIR/slurm.conf" <<EOF
# Written by scripts/slurm/local_cluster.sh: one node, everything as root, no cgroups.
ClusterName=pyramidkv
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/state/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((PORT + 2))
AccountingStoragePass=$DIR/munge/munge.socket
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=5
MailProg=/bin/true
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  # slurmdbd reads slurmdbd.conf beside $SLURM_CONF; it holds the database password, so only root reads it.
  ( umask 077; cat > "$DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((PORT + 2))
SlurmUser=root
PidFile=$DIR/state/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$((PORT + 3))
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  )
}

sql() { mariadb --no-defaults --socket="$DIR/mysql/mysqld.sock" <<< "$1"; }   # on stdin: no password in ps

start_mariadb() {   # a private MariaDB on 127.0.0.1:PORT+3; the user slurmdbd logs in as gets a new password
  if [ ! -d "$DIR/mysql/data/mysql" ]; then
    mariadb-install-db --no-defaults --datadir="$DIR/mysql/data" --user=root --skip-test-db \
      >>"$DIR/log/mariadbd.log" 2>&1 || fail mariadbd "could not create its database folder"
  fi
  launch mariadbd mariadbd --no-defaults --datadir="$DIR/mysql/data" --user=root --socket="$DIR/mysql/mysqld.sock" \
    --bind-address=127.0.0.1 --port=$((PORT + 3)) --skip-name-resolve --innodb-lock-wait-timeout=900 \
    --pid-file="$DIR/state/mariadbd.pid" --log-error="$DIR/log/mariadbd.log"
  wait_for mariadbd "answering" sql "SELECT 1"
  sql "CREATE OR REPLACE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
       GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" >>"$DIR/log/mariadbd.log" 2>&1 \
    || fail mariadbd "refused to create the slurm user"
}

node_state() { sinfo -h -N -o %t 2>/dev/null | head -n 1; }
node_idle() { [ "$(node_state)" = idle ]; }
node_up() { [[ "$(node_state)" =~ ^(idle|mix|alloc|comp)$ ]]; }   # running jobs or ready for them
cluster_registered() { sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx pyramidkv; }

start() {
  local d
  for d in "${DAEMONS[@]}" mariadb-install-db mariadb sbatch sacct; do
    command -v "$d" >/dev/null || { say "error: $d is not installed (scripts/slurm/local_cluster.sh install: $PACKAGES)" >&2; exit 1; }
  done
  [ "$(id -u)" = 0 ] || { say "error: run as root (the daemons run as root here)" >&2; exit 1; }
  if status >/dev/null 2>&1; then echo "already running: export SLURM_CONF=$SLURM_CONF"; return 0; fi
  stop >/dev/null
  DEADLINE=$(( SECONDS + WAIT_S ))
  DB_PASS=$(head -c 18 /dev/urandom | base64 | tr -dc A-Za-z0-9)
  write_config
  launch munged munged --foreground --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/state/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed"
  wait_for munged "answering" munge -S "$DIR/munge/munge.socket" -n
  start_mariadb
  launch slurmdbd slurmdbd -D
  wait_for slurmdbd "answering" sacctmgr -n list cluster
  cluster_registered || sacctmgr -i add cluster pyramidkv >>"$DIR/log/slurmdbd.log" 2>&1 \
    || fail slurmdbd "did not register the cluster"
  launch slurmctld slurmctld -D
  launch slurmd slurmd -D
  wait_for slurmctld "answering" sinfo
  until node_idle; do
    for d in "${DAEMONS[@]}"; do pid_of "$d" >/dev/null || fail "$d" "exited before the node was idle"; done
    [ "$SECONDS" -lt "$DEADLINE" ] || fail slurmd "runs but the node is '$(node_state)', not idle, after ${WAIT_S}s"
    sleep 0.3
  done
  echo "started: export SLURM_CONF=$SLURM_CONF"
}

stop() {   # cancels the jobs (their steps would outlive slurmd), then stops the daemons in reverse order
  local d pid i jobs
  if pid_of slurmctld >/dev/null && jobs=$(squeue -h -o %i 2>/dev/null) && [ -n "$jobs" ]; then
    scancel $jobs && echo "cancelled jobs: $(echo $jobs)"
    for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  for (( i = ${#DAEMONS[@]} - 1; i >= 0; i-- )); do
    d=${DAEMONS[$i]}
    if pid=$(pid_of "$d"); then
      kill "$pid"
      for _ in $(seq 100); do pid_of "$d" >/dev/null || break; sleep 0.1; done
      if pid_of "$d" >/dev/null; then kill -9 "$pid"; fi
      echo "stopped $d ($pid)"
    fi
    rm -f "$DIR/run/$d.pid"
  done
}

status() {   # exit status 0: every daemon runs and the node runs jobs or waits for them
  local d pid ok=0
  for d in "${DAEMONS[@]}"; do
    if pid=$(pid_of "$d"); then echo "$d: running ($pid)"; else echo "$d: not running"; ok=1; fi
  done
  if [ "$ok" = 0 ]; then echo "node: $(node_state)"; node_up || ok=1; fi
  return "$ok"
}

install_packages() {   # no-op when installed; a policy-rc.d of its own keeps the packages' services from starting
  if dpkg -s $PACKAGES >/dev/null 2>&1; then return 0; fi
  local policy=/usr/sbin/policy-rc.d added=0 rc=0
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' > $policy; chmod +x $policy; added=1; fi
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null; } || rc=$?
  if [ "$added" = 1 ]; then rm -f $policy; fi
  return $rc
}

lock() { exec 9>"${DIR%/}.lock"; flock 9; }   # one start or stop at a time (pytest-xdist workers, two shells)

case "${1:-}" in
  start) lock; start ;;
  stop) lock; stop ;;
  status) status ;;
  install) install_packages ;;
  *) sed -n 2,9p "$0"; exit 2 ;;
esac
