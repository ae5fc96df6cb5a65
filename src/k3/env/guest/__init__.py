"""The guest side of the ``vm`` backend: the ``/init`` of the initramfs (busybox ``sh``).

It mounts the pseudo filesystems, loads the virtio modules, puts every command into the cgroup
``/sys/fs/cgroup/box`` (memory.max, pids.max, cpu.max from the kernel command line ``k3.*``
arguments) and serves the host on ``/dev/hvc0`` (a virtio console, raw mode). The agent stays in
the root cgroup, so a command that is OOM-killed or forks without bound cannot take it down.

Wire protocol (one request at a time; host payloads are escaped text, guest output is raw bytes;
every process the agent starts costs tens of ms under TCG, so it starts few):

    host -> guest  ``K3 <tag> run <timeout_s> <cap> <n_script> <n_stdin>\\n``, the ``sh`` script as
                   one line in ``printf %b`` escapes (decoded by the shell's builtin printf: no
                   process), then n_stdin bytes of base64 stdin;  ``K3 <tag> ping\\n``
    guest -> host  ``K3R <tag> <rc> <timed_out> <oom_kills> <out_size> <err_size> <n_out> <n_err>\\n``
                   then n_out + n_err raw bytes (the first ``cap`` bytes of stdout, of stderr; the
                   tty is raw, ``-opost``, so output passes unchanged) in windows of ``WINDOW``
                   bytes (stdout's, then stderr's);  ``K3R <tag> pong\\n``
    host -> guest  ``K3A <tag>\\n`` once the host holds a whole window, for every window but the
                   reply's last: the guest sends the next one only then. QEMU gives a console port
                   no flow control and drops what its socket cannot take at once (a 1 MiB reply
                   lost 34 KiB while the host was busy); a window is far below the socket's buffer.
                   A request that arrives instead of an ack means the host gave the reply up.

The guest reads a payload with ``dd iflag=fullblock`` (exactly n bytes; ``head -c`` reads ahead
on a tty). A command runs in its own session (``setsid``); on timeout a watchdog kills that whole
process group. Lines that do not start with ``K3`` are ignored, so noise on the channel (a tty
echo before the agent set raw mode) cannot desynchronize it.
"""

WINDOW = 1 << 16   # bytes of a reply in flight before the guest waits for the host's ack

_INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /tmp /run /sbin /usr/bin /usr/sbin /workspace
/bin/busybox mount -t proc proc /proc
/bin/busybox --install -s /bin
export PATH=/bin:/sbin:/usr/bin:/usr/sbin HOME=/root
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs -o mode=1777 tmp /tmp
mount -t tmpfs -o mode=755 run /run
arg() { for w in $(cat /proc/cmdline); do case $w in "k3.$1="*) echo "${w#*=}"; return;; esac; done; }
ws=$(arg disk)
if [ -n "$ws" ]; then mount -t tmpfs -o size=$ws ws /workspace; else mount -t tmpfs ws /workspace; fi
mkdir -p /root /sys/fs/cgroup /run/k3
mount -t cgroup2 cg /sys/fs/cgroup
for c in memory pids cpu; do echo +$c > /sys/fs/cgroup/cgroup.subtree_control; done
box=/sys/fs/cgroup/box
mkdir -p $box
v=$(arg mem); [ -n "$v" ] && echo $v > $box/memory.max && echo 0 > $box/memory.swap.max 2>/dev/null
v=$(arg pids); [ -n "$v" ] && echo $v > $box/pids.max
v=$(arg cpu); [ -n "$v" ] && echo "$v 100000" > $box/cpu.max
for m in virtio_ring virtio virtio_mmio virtio_console; do insmod /lib/modules/$m.ko; done
i=0
while [ ! -e /dev/hvc0 ] && [ $i -lt 500 ]; do sleep 0.02; i=$((i+1)); done
hostname sandbox
cat > /run/k3/agent <<'AGENT'
stty raw -echo -iexten cs8 -parenb
d=/run/k3
oomk() { n=0; while read -r k v; do [ "$k" = oom_kill ] && n=$v; done < /sys/fs/cgroup/box/memory.events; }
k3_run() {
  tag=$1 t=$2 cap=$3
  IFS= read -r s
  printf '%b' "$s" > $d/cmd.sh
  if [ "$5" -gt 0 ]; then dd bs=$5 count=1 iflag=fullblock 2> /dev/null | base64 -d > $d/in; else : > $d/in; fi
  oomk; o0=$n
  : > $d/to
  setsid sh -c 'echo $$ > /sys/fs/cgroup/box/cgroup.procs; exec sh "$1" < "$2" > "$3" 2> "$4"' \
    k3 $d/cmd.sh $d/in $d/out $d/err &
  pid=$!
  w=
  if [ "$t" != 0 ]; then setsid sh -c "sleep $t; echo 1 > $d/to; kill -9 -$pid" > /dev/null 2>&1 & w=$!; fi
  wait $pid
  rc=$?
  [ -n "$w" ] && kill -9 -$w 2> /dev/null
  to=0; [ $rc = 137 ] && [ -s $d/to ] && to=1
  oomk
  set -- $(stat -c %s $d/out $d/err)
  no=$1 ne=$2
  [ $no -gt $cap ] && no=$cap
  [ $ne -gt $cap ] && ne=$cap
  printf 'K3R %s %s %s %s %s %s %s %s\n' $tag $rc $to $((n - o0)) $1 $2 $no $ne
  total=$((no + ne)) sent=0
  send $d/out $no && send $d/err $ne
}
# send FILE N: its first N bytes, one window at a time; after every window but the reply's last,
# wait for the host's ack (a console has no flow control: QEMU drops what the socket cannot take)
send() {
  left=$2 i=0
  while [ $left -gt 0 ]; do
    len=$left; [ $len -gt @WINDOW@ ] && len=@WINDOW@
    dd if=$1 bs=@WINDOW@ skip=$i count=$len iflag=count_bytes 2> /dev/null
    left=$((left - len)) i=$((i + 1)) sent=$((sent + len))
    [ $sent -lt $total ] && { ack || return 1; }
  done
  return 0
}
# ack: read up to the host's "K3A <tag>"; a new request instead means the host gave this reply up:
# keep that line for the main loop and stop sending
ack() {
  while IFS= read -r l; do
    case $l in "K3A $tag") return 0 ;; "K3 "*) next=$l; return 1 ;; esac
  done
  return 1
}
set -f
next=
while if [ -n "$next" ]; then l=$next; next=; else IFS= read -r l; fi; do
  set -- $l
  [ "$1" = K3 ] || continue
  case $3 in
    ping) printf 'K3R %s pong\n' $2 ;;
    run) k3_run $2 $4 $5 $6 $7 ;;
  esac
done
AGENT
cd /workspace
while :; do sh /run/k3/agent < /dev/hvc0 > /dev/hvc0 2> /dev/console; sleep 0.1; done
"""
INIT = _INIT.replace("@WINDOW@", str(WINDOW))
