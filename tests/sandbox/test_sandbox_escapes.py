"""Escape attempts against the container sandbox, each one run for real inside it.

Every kind an attacker test tried, and where it is tested (one test per kind;
kinds tests/sandbox/test_sandbox.py already covers are counted, not repeated):

| #  | escape kind                                        | tested by (TC = test_sandbox.py::TestContainer) |
|----|----------------------------------------------------|--------------------------------------------------|
| 1  | user namespaces: unshare, clone, clone3, setns,    | test_user_namespaces_are_refused                 |
|    | unshare(1), the i386 and x32 syscall ABIs          |                                                  |
| 2  | mounting a tmpfs, the mount family, chroot         | test_mounts_are_refused                          |
| 3  | /proc and /sys: host info, kcore, /proc/sys writes | test_proc_and_sys_show_nothing_of_the_host       |
| 4  | the podman/docker engine socket                    | test_engine_socket_is_unreachable                |
| 5  | unix and abstract sockets of the host              | test_host_unix_sockets_are_unreachable           |
| 6  | symlinks and hardlinks out of /scratch             | test_links_out_of_scratch_lead_nowhere           |
| 7  | setuid/setgid binaries, setuid(0)                  | test_no_way_to_root                              |
| 8  | ptrace and other cross-process calls               | test_ptrace_and_cross_process_calls_are_refused  |
| 9  | raw, packet and unusual sockets                    | test_raw_and_unusual_sockets_are_refused         |
| 10 | DNS resolution                                     | TC::test_network_is_off (not repeated here)      |
| 11 | connecting to the host, 10.0.2.2, metadata, ...    | test_remote_addresses_are_unreachable (loopback: |
|    |                                                    | TC::test_network_is_off)                         |
| 12 | double-fork CPU burner outliving its parent        | test_double_fork_burner_dies_with_the_run        |
| 13 | file floods: inodes; bytes                         | test_inode_flood_is_contained;                   |
|    |                                                    | TC::test_scratch_is_size_capped                  |
| 14 | output floods                                      | TC::test_huge_output_is_capped                   |
| 15 | non-UTF-8 output                                   | test_non_utf8_output_is_read_safely              |
| 16 | bpf                                                | test_bpf_is_refused                              |
| 17 | perf_event_open                                    | test_perf_event_open_is_refused                  |
| 18 | userfaultfd                                        | test_userfaultfd_is_refused                      |
| 19 | keyctl, add_key, request_key                       | test_keyring_is_refused                          |
| 20 | io_uring                                           | test_io_uring_is_refused                         |
| 21 | personality (ASLR off, other personas)             | test_personality_stays_default                   |
| 22 | fork bombs                                         | TC::test_fork_bomb_stops_at_pids_limit,          |
|    |                                                    | TC::test_endless_fork_bomb_is_killed             |
| 23 | memory bombs                                       | TC::test_memory_bomb_is_oom_killed               |
| 24 | endless loops and sleeps                           | TC::test_infinite_loop_times_out,                |
|    |                                                    | TC::test_silent_sleep_times_out                  |

Writes outside /scratch and host files are TC::test_writes_only_in_scratch and
TC::test_host_files_are_invisible. Beyond the 24: the host-only syscalls
(kexec, modules, reboot, swap, clock, ...) in test_host_only_calls_are_refused,
construction refusing an engine that does not apply the profile, and the
profile's own shape (TestProfile, no engine needed).

Kinds 16-21 share one run (the `surfaces` fixture); each other kind is one run
of batched probes. Syscalls are made through ctypes with the numbers of x86_64
or aarch64, with arguments that would work without a filter where possible;
probes fork before anything that could succeed, so that one success cannot
change what the next probe sees. Run under podman's default seccomp profile
instead of relax_gym's (measured), test_user_namespaces_are_refused fails:
unshare(CLONE_NEWUSER), clone and clone3 with it, `unshare -Urm` mounting a
tmpfs, and i386's unshare all succeed there; so do the mount, ptrace, socket,
io_uring, keyring, personality and host-only tests, on their refusal's errno.
Outcomes are asserted, never durations.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import secrets
import socket
import stat
import warnings
from pathlib import Path
from types import SimpleNamespace

import docker
import pytest

from relax_gym.sandbox import Sandbox, SandboxConfig, SandboxError, SandboxUnavailableError, seccomp
from relax_gym.sandbox import container as container_mod

pytestmark = pytest.mark.timeout(120)

# Syscall numbers, from libseccomp's tables; the container runs on the host's architecture.
_SYSCALLS = {
    "x86_64": {
        "unshare": 272, "setns": 308, "clone": 56, "clone3": 435, "mount": 165, "umount2": 166,
        "pivot_root": 155, "chroot": 161, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "move_mount": 429, "open_tree": 428, "mount_setattr": 442, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "keyctl": 250, "add_key": 248, "request_key": 249, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "personality": 135, "ptrace": 101,
        "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_open": 434, "pidfd_getfd": 438,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "kexec_load": 246, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
        "settimeofday": 164, "clock_settime": 227, "syslog": 103, "fanotify_init": 300, "quotactl": 179,
    },
    "aarch64": {
        "unshare": 97, "setns": 268, "clone": 220, "clone3": 435, "mount": 40, "umount2": 39,
        "pivot_root": 41, "chroot": 51, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "move_mount": 429, "open_tree": 428, "mount_setattr": 442, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "keyctl": 219, "add_key": 217, "request_key": 218, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "personality": 92, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_open": 434, "pidfd_getfd": 438,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "kexec_load": 104, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89,
        "settimeofday": 170, "clock_settime": 112, "syslog": 116, "fanotify_init": 262, "quotactl": 60,
    },
}  # fmt: skip

# Put in front of every probe: raw syscalls by name, and a fork around each attempt.
_PRELUDE = f"SYSCALLS = {_SYSCALLS!r}\n" + (
    r'''
import ctypes, errno, json, os, platform, socket, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = SYSCALLS.get(platform.machine(), {})
results = {}

def call(number, *args):
    """A raw syscall: its result, or the name of its errno."""
    ctypes.set_errno(0)
    ret = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return ret if ret >= 0 else errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())

def sys_(name, *args):
    return call(NR[name], *args)

def in_child(fn, *args):
    """fn(*args) in a forked child: what it returned, or how the child died."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = fn(*args)
        except BaseException as exc:
            out = f"raised {type(exc).__name__}: {exc}"
        os.write(w, json.dumps(out, default=str).encode())
        os._exit(0)
    os.close(w)
    data = b"".join(iter(lambda: os.read(r, 65536), b""))
    os.close(r)
    status = os.waitpid(pid, 0)[1]
    return json.loads(data) if data else f"child died: {os.waitstatus_to_exitcode(status)}"

def errname(fn, *args):
    try:
        fn(*args)
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))

def status_field(name):
    return [line.split(":", 1)[1].strip() for line in open("/proc/self/status") if line.startswith(name + ":")][0]
'''
)
_REPORT = "\nprint(json.dumps(results, default=str))\n"

DENIED = "EPERM"  # what the profile answers for what it refuses outright


@pytest.fixture(scope="module")
def box(container_sandbox: Sandbox) -> Sandbox:
    """The container-backed sandbox with the default limits (tests/conftest.py)."""
    if platform.machine() not in _SYSCALLS:
        pytest.skip(f"no syscall numbers for {platform.machine()} in this test")
    return container_sandbox


def probe(box: Sandbox, body: str, **run_kwargs) -> dict:
    """Run `body` after the prelude; it fills `results`, returned here."""
    result = box.run(_PRELUDE + body + _REPORT, **run_kwargs)
    assert result.ok, result.summary()
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.container
class TestNamespacesAndMounts:
    def test_user_namespaces_are_refused(self, box: Sandbox) -> None:
        body = r"""
NEWUSER, NEWNS, NEWNET, NEWPID = 0x10000000, 0x00020000, 0x40000000, 0x20000000
NEWUTS, NEWIPC, NEWCGROUP, SIGCHLD = 0x04000000, 0x08000000, 0x02000000, 17
results["os.unshare"] = in_child(errname, os.unshare, os.CLONE_NEWUSER) if hasattr(os, "unshare") else "absent"
for label, flags in [("user", NEWUSER), ("user+mnt", NEWUSER | NEWNS), ("net", NEWNET), ("none", 0)]:
    results[f"unshare {label}"] = in_child(sys_, "unshare", flags)
results["libc unshare user"] = in_child(
    lambda: "ok" if libc.unshare(NEWUSER) == 0 else errno.errorcode[ctypes.get_errno()])

def raw_clone(flags):
    pid = sys_("clone", flags | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)  # the child of a successful clone: it must not run the rest
    if isinstance(pid, int):
        os.waitpid(pid, 0)
        return "cloned"
    return pid

for label, flags in [("user", NEWUSER), ("mnt", NEWNS), ("net", NEWNET), ("pid", NEWPID), ("uts", NEWUTS),
                     ("ipc", NEWIPC), ("cgroup", NEWCGROUP), ("user+mnt+net", NEWUSER | NEWNS | NEWNET), ("none", 0)]:
    results[f"clone {label}"] = in_child(raw_clone, flags)

def raw_clone3(flags):
    args = (ctypes.c_uint64 * 11)(flags, 0, 0, 0, SIGCHLD, 0, 0, 0, 0, 0, 0)
    pid = sys_("clone3", ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
    if pid == 0:
        os._exit(0)
    if isinstance(pid, int):
        os.waitpid(pid, 0)
        return "cloned"
    return pid

results["clone3 user"] = in_child(raw_clone3, NEWUSER)
results["clone3 none"] = in_child(raw_clone3, 0)

def join(path):
    fd = os.open(path, os.O_RDONLY)
    return sys_("setns", fd, 0)

for ns in sorted(os.listdir("/proc/self/ns")):
    results[f"setns {ns}"] = in_child(join, f"/proc/self/ns/{ns}")

if os.path.exists("/usr/bin/unshare"):
    for args in (["-U", "true"], ["-Ur", "id", "-u"], ["-Urm", "sh", "-c", "mount -t tmpfs none /tmp && echo mounted"],
                 ["-Urn", "true"]):
        proc = subprocess.run(["unshare", *args], capture_output=True, text=True)
        results["unshare " + " ".join(args)] = [proc.returncode, proc.stdout + proc.stderr]
else:
    results["unshare binary"] = "absent"

if platform.machine() == "x86_64":
    import mmap
    def legacy_abi(code):
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(code)
        return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
    # i386's unshare (310) through int 0x80: push rbx; mov eax, 310; mov ebx, CLONE_NEWUSER; int 0x80; pop rbx; ret
    code = b"\x53\xb8" + (310).to_bytes(4, "little") + b"\xbb" + NEWUSER.to_bytes(4, "little") + b"\xcd\x80\x5b\xc3"
    results["i386 unshare"] = in_child(legacy_abi, code)
    results["x32 unshare"] = in_child(call, 0x40000000 | NR["unshare"], NEWUSER)
results["CapEff"] = status_field("CapEff")
results["NoNewPrivs"] = status_field("NoNewPrivs")
results["Seccomp"] = status_field("Seccomp")
"""
        seen = probe(box, body)
        expected = {f"unshare {label}": DENIED for label in ("user", "user+mnt", "net", "none")}
        expected["libc unshare user"] = DENIED
        clones = ("user", "mnt", "net", "pid", "uts", "ipc", "cgroup", "user+mnt+net")
        expected |= {f"clone {label}": DENIED for label in clones}
        expected["clone none"] = "cloned"  # plain fork through the filtered clone still works
        expected |= {"clone3 user": "ENOSYS", "clone3 none": "ENOSYS"}  # glibc falls back to clone
        expected |= {key: DENIED for key in seen if key.startswith("setns ")}
        assert {key: seen[key] for key in expected} == expected
        assert {"setns user", "setns mnt", "setns net"} <= expected.keys()
        if seen["os.unshare"] != "absent":  # Python 3.12+
            assert seen["os.unshare"] == DENIED
        if seen.get("unshare binary") == "absent":
            warnings.warn("unshare(1) is not in the image: that sub-check did not run", stacklevel=1)
        for key, (code, output) in ((k, v) for k, v in seen.items() if k.startswith("unshare -")):
            assert code != 0 and "Operation not permitted" in output, f"{key}: {code} {output!r}"
            assert "mounted" not in output
        if platform.machine() == "x86_64":
            # Other ABIs are outside the filter's architectures: the process dies of SIGSYS.
            assert seen["i386 unshare"] == f"child died: {-31}", seen["i386 unshare"]
            assert seen["x32 unshare"] == f"child died: {-31}", seen["x32 unshare"]
        assert (seen["CapEff"], seen["NoNewPrivs"], seen["Seccomp"]) == ("0000000000000000", "1", "2")

    def test_mounts_are_refused(self, box: Sandbox) -> None:
        body = r"""
os.mkdir("/scratch/m")
results["mount"] = in_child(lambda: "ok" if libc.mount(b"none", b"/scratch/m", b"tmpfs", 0, b"size=1g") == 0
                            else errno.errorcode[ctypes.get_errno()])
results["umount2"] = in_child(sys_, "umount2", b"/scratch", 2)
results["pivot_root"] = in_child(sys_, "pivot_root", b"/scratch", b"/scratch/m")
results["chroot"] = in_child(sys_, "chroot", b"/scratch")
results["fsopen"] = in_child(sys_, "fsopen", b"tmpfs", 0)
results["open_tree"] = in_child(sys_, "open_tree", -100, b"/scratch", 1)  # OPEN_TREE_CLONE
results["fspick"] = in_child(sys_, "fspick", -100, b"/scratch", 0)
results["move_mount"] = in_child(sys_, "move_mount", -100, b"/scratch", -100, b"/scratch/m", 0)
results["fsmount"] = in_child(sys_, "fsmount", 3, 0, 0)
results["fsconfig"] = in_child(sys_, "fsconfig", 3, 6, 0, 0, 0)
results["mount_setattr"] = in_child(sys_, "mount_setattr", -100, b"/scratch", 0, 0, 0)
# util-linux mount is setuid root; with no_new_privs it stays the user that ran it.
proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "none", "/scratch/m"], capture_output=True, text=True)
results["mount(8)"] = [proc.returncode, proc.stderr]
results["mounted at /scratch/m"] = any(" /scratch/m " in line for line in open("/proc/self/mountinfo"))
"""
        seen = probe(box, body)
        syscalls = {key: value for key, value in seen.items() if key not in ("mount(8)", "mounted at /scratch/m")}
        assert syscalls == dict.fromkeys(syscalls, DENIED), syscalls
        code, stderr = seen["mount(8)"]
        assert code != 0 and "must be superuser" in stderr, seen["mount(8)"]
        assert seen["mounted at /scratch/m"] is False


@pytest.mark.container
class TestHost:
    def test_proc_and_sys_show_nothing_of_the_host(self, box: Sandbox, monkeypatch) -> None:
        token = secrets.token_hex(16)
        monkeypatch.setenv("RELAX_GYM_ESCAPE_TOKEN", token)  # in this (host) process's environment only
        body = r"""
environs = {}
for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
    try:
        environs[pid] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
    except OSError as exc:
        environs[pid] = errno.errorcode.get(exc.errno)
results["environ"] = environs
results["pid 1"] = open("/proc/1/cmdline", "rb").read().decode().split("\0")[:3]

def read(path):
    try:
        with open(path, "rb") as fh:
            return len(fh.read(4096))
    except OSError as exc:
        return errno.errorcode.get(exc.errno)

results["reads"] = {path: read(path) for path in ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/kmsg",
                                                 "/proc/sched_debug", "/dev/kmsg", "/dev/mem", "/dev/kvm"]}
results["kallsyms addresses"] = sorted({line.split()[0] for line in open("/proc/kallsyms")})[:2]

def write(path):
    try:
        with open(path, "w") as fh:
            fh.write("1")
        return "written"
    except OSError as exc:
        return errno.errorcode.get(exc.errno)

results["writes"] = {path: write(path) for path in [
    "/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches", "/proc/sys/kernel/core_pattern", "/proc/sysrq-trigger",
    "/sys/kernel/mm/transparent_hugepage/enabled", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
    "/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/pids.max"]}
results["syslog"] = sys_("syslog", 3, ctypes.create_string_buffer(4096), 4096)  # SYSLOG_ACTION_READ_ALL
results["/sys/firmware"] = os.listdir("/sys/firmware")
"""
        seen = probe(box, body)
        assert not any(token in text for text in seen["environ"].values())
        assert all(pid in ("1",) or int(pid) < 100 for pid in seen["environ"])  # its own PID namespace
        assert seen["pid 1"][1:] == ["-u", "/sandbox/main.py"]  # PID 1 is the sandboxed program
        # Masked (empty), absent, or refused: never content.
        assert all(value in (0, "ENOENT", "EACCES", "EPERM") for value in seen["reads"].values()), seen["reads"]
        assert seen["kallsyms addresses"] == ["0000000000000000"]  # kernel addresses hidden
        assert all(value in ("EROFS", "EACCES", "ENOENT", "EPERM") for value in seen["writes"].values()), seen["writes"]
        assert seen["syslog"] == DENIED
        assert seen["/sys/firmware"] == []

    def test_engine_socket_is_unreachable(self, box: Sandbox) -> None:
        engine_path = (box.engine_url or "").removeprefix("unix://")
        body = rf"""
candidates = sorted({{{engine_path!r}, "/run/podman/podman.sock", "/var/run/podman/podman.sock",
                     "/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock",
                     "/run/user/0/podman/podman.sock", "/run/user/1000/podman/podman.sock"}})

def connect(path):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(3)
        sock.connect(path)
        sock.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
        return sock.recv(100).decode(errors="replace")

results["connect"] = {{path: in_child(lambda p=path: errname(connect, p)) for path in candidates}}
import stat
sockets = []
for root, dirs, files in os.walk("/"):
    if root == "/":
        dirs[:] = [d for d in dirs if d not in ("proc", "sys")]
    for name in files:
        try:
            if stat.S_ISSOCK(os.lstat(os.path.join(root, name)).st_mode):
                sockets.append(os.path.join(root, name))
        except OSError:
            pass
results["sockets on the filesystem"] = sockets
"""
        seen = probe(box, body)
        assert all(value == "ENOENT" for value in seen["connect"].values()), seen["connect"]
        assert seen["sockets on the filesystem"] == []

    def test_host_unix_sockets_are_unreachable(self, box: Sandbox, tmp_path: Path) -> None:
        abstract = "\0relax-gym-escape-" + secrets.token_hex(8)
        with socket.socket(socket.AF_UNIX) as listener, socket.socket(socket.AF_UNIX) as on_disk:
            listener.bind(abstract)
            listener.listen()
            on_disk.bind(str(tmp_path / "host.sock"))
            on_disk.listen()
            body = rf"""
def connect(address):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(3)
        sock.connect(address)
    return "connected"

results["abstract"] = errname(connect, {abstract!r})
results["path"] = errname(connect, {str(tmp_path / "host.sock")!r})
# The container's own abstract namespace works: it is a separate one, not a closed one.
own = socket.socket(socket.AF_UNIX)
own.bind({abstract!r})
own.listen()
results["own abstract"] = errname(connect, {abstract!r})
"""
            seen = probe(box, body)
        assert seen == {"abstract": "ECONNREFUSED", "path": "ENOENT", "own abstract": "ok"}, seen

    def test_links_out_of_scratch_lead_nowhere(self, box: Sandbox, tmp_path: Path) -> None:
        secret = tmp_path / "secret.txt"
        token = secrets.token_hex(16)
        secret.write_text(token)
        body = rf"""
host_file = {str(secret)!r}
targets = {{
    "host path": host_file,
    "via /proc/1/root": "/proc/1/root/../../.." + host_file,
    "via /proc/self/cwd": "/proc/self/cwd/../../../.." + host_file,
    "dotdot": "../../../../../.." + host_file,
}}
reads = {{}}
for label, target in targets.items():
    link = "/scratch/link-" + label.replace(" ", "-").replace("/", "")
    os.symlink(target, link)
    try:
        reads[label] = open(link).read()
    except OSError as exc:
        reads[label] = errno.errorcode.get(exc.errno)
results["reads"] = reads
results["hardlink /etc/passwd"] = errname(os.link, "/etc/passwd", "/scratch/passwd")
results["hardlink /sandbox/main.py"] = errname(os.link, "/sandbox/main.py", "/scratch/main.py")
results["root of pid 1"] = os.readlink("/proc/1/root")
results["/proc/1/root/etc/hostname"] = open("/proc/1/root/etc/hostname").read().strip()
"""
        seen = probe(box, body)
        assert token not in json.dumps(seen)
        assert set(seen["reads"].values()) == {"ENOENT"}, seen["reads"]
        assert seen["hardlink /etc/passwd"] == "EXDEV"  # another filesystem: a link cannot reach out
        assert seen["hardlink /sandbox/main.py"] == "EXDEV"
        assert seen["root of pid 1"] == "/"
        assert seen["/proc/1/root/etc/hostname"] == "sandbox"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]  # nothing came out

    def test_no_way_to_root(self, box: Sandbox) -> None:
        body = r"""
results["setuid(0)"] = in_child(errname, os.setuid, 0)
results["setgid(0)"] = in_child(errname, os.setgid, 0)
results["setresuid(0,0,0)"] = in_child(errname, os.setresuid, 0, 0, 0)
results["setgroups([0])"] = in_child(errname, os.setgroups, [0])
results["setreuid(-1,0)"] = in_child(errname, os.setreuid, -1, 0)
setuid_files = subprocess.run("find / -xdev -perm /6000 -type f", shell=True, capture_output=True, text=True)
results["setuid files"] = setuid_files.stdout.split()
# A setuid-root mount(8) that became root would try the mount(2) and fail with EPERM; one
# that did not (no_new_privs ignores the bit) refuses up front as an ordinary user.
proc = subprocess.run(["mount", "-t", "tmpfs", "none", "/scratch"], capture_output=True, text=True)
results["mount(8)"] = proc.stderr
proc = subprocess.run(["su", "-c", "id -u", "root"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                      timeout=20)
results["su"] = [proc.returncode, proc.stdout]
results["NoNewPrivs"] = status_field("NoNewPrivs")
results["ids"] = [os.getresuid(), os.getresgid(), os.getgroups()]
"""
        seen = probe(box, body)
        for call in ("setuid(0)", "setgid(0)", "setresuid(0,0,0)", "setgroups([0])", "setreuid(-1,0)"):
            assert seen[call] == "EPERM", (call, seen[call])
        assert seen["setuid files"], "the image has setuid binaries: the check below means something"
        assert "must be superuser" in seen["mount(8)"], seen["mount(8)"]
        assert seen["su"][0] != 0 and seen["su"][1].strip() != "0", seen["su"]
        assert seen["NoNewPrivs"] == "1"
        assert seen["ids"] == [[65534] * 3, [65534] * 3, [65534]]


@pytest.mark.container
class TestProcessesAndNetwork:
    def test_ptrace_and_cross_process_calls_are_refused(self, box: Sandbox) -> None:
        body = r"""
import time
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
buf = ctypes.create_string_buffer(64)
iov = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 64)
results["ptrace attach"] = in_child(sys_, "ptrace", 16, child, 0, 0)  # PTRACE_ATTACH
results["ptrace seize"] = in_child(sys_, "ptrace", 0x4206, child, 0, 0)  # PTRACE_SEIZE
results["ptrace traceme"] = in_child(sys_, "ptrace", 0, 0, 0, 0)
results["ptrace pid 1"] = in_child(sys_, "ptrace", 16, 1, 0, 0)
results["process_vm_readv"] = sys_("process_vm_readv", child, iov, 1, iov, 1, 0)
results["process_vm_writev"] = sys_("process_vm_writev", child, iov, 1, iov, 1, 0)
results["kcmp"] = sys_("kcmp", os.getpid(), child, 0, 0, 0)  # KCMP_FILE
pidfd = os.pidfd_open(child)
results["pidfd_getfd"] = sys_("pidfd_getfd", pidfd, 0, 0)
os.kill(child, 9)
os.waitpid(child, 0)
"""
        seen = probe(box, body)
        assert seen == dict.fromkeys(seen, DENIED), seen

    def test_raw_and_unusual_sockets_are_refused(self, box: Sandbox) -> None:
        body = r"""
attempts = {
    "AF_INET raw": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
    "AF_INET6 raw": (socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6),
    "AF_INET icmp datagram": (socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP),
    "AF_PACKET": (17, socket.SOCK_RAW, 0x300),
    "AF_NETLINK audit": (16, socket.SOCK_RAW, 9),
    "AF_NETLINK uevent": (16, socket.SOCK_RAW, 15),
    "AF_NETLINK netfilter": (16, socket.SOCK_RAW, 12),
    "AF_KEY": (15, socket.SOCK_RAW, 2),
    "AF_ALG": (38, socket.SOCK_SEQPACKET, 0),
    "AF_VSOCK": (40, socket.SOCK_STREAM, 0),
    "AF_XDP": (44, socket.SOCK_RAW, 0),
    "AF_TIPC": (30, socket.SOCK_RDM, 0),
    "AF_RDS": (21, socket.SOCK_SEQPACKET, 0),
    "AF_BLUETOOTH": (31, socket.SOCK_RAW, 0),
    "AF_CAN": (29, socket.SOCK_RAW, 1),
}
results = {label: errname(lambda args=args: socket.socket(*args).close()) for label, args in attempts.items()}
results["AF_NETLINK route (allowed)"] = errname(lambda: socket.socket(16, socket.SOCK_RAW, 0).close())
"""
        seen = probe(box, body)
        assert seen.pop("AF_NETLINK route (allowed)") == "ok"
        # The kernel refuses raw and ICMP sockets to a process without CAP_NET_RAW (EPERM, or EACCES
        # from ping_group_range); the profile refuses every other family before the kernel sees it.
        kernel = {key: seen.pop(key) for key in ("AF_INET raw", "AF_INET6 raw", "AF_INET icmp datagram")}
        assert set(kernel.values()) <= {"EPERM", "EACCES"}, kernel
        assert seen == dict.fromkeys(seen, "EAFNOSUPPORT"), seen

    def test_remote_addresses_are_unreachable(self, box: Sandbox) -> None:
        host_ips = set()
        for family, address in ((socket.AF_INET, "10.255.255.255"), (socket.AF_INET6, "2001:db8::1")):
            with socket.socket(family, socket.SOCK_DGRAM) as probe_socket:
                try:  # the address the host would use to reach the outside
                    probe_socket.connect((address, 9))
                    host_ips.add(probe_socket.getsockname()[0])
                except OSError:
                    pass
        targets = [
            ("10.0.2.2", 80), ("10.0.2.3", 53), ("10.88.0.1", 80), ("169.254.169.254", 80), ("8.8.8.8", 53),
            ("2001:4860:4860::8888", 53), ("fe80::1", 80), *((ip, 22) for ip in sorted(host_ips)),
        ]  # fmt: skip
        body = rf"""
def tcp(host, port):
    with socket.create_connection((host, port), timeout=3):
        return "connected"

def udp(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"x", (host, port))
    return "sent"

for host, port in {targets!r}:
    results[f"tcp {{host}}"] = errname(tcp, host, port)
    results[f"udp {{host}}"] = errname(udp, host, port)
results["routes"] = open("/proc/net/route").read().splitlines()[1:]
"""
        seen = probe(box, body)
        assert seen.pop("routes") == []  # loopback only: no route anywhere
        assert all(value in ("ENETUNREACH", "EHOSTUNREACH", "EADDRNOTAVAIL", "EINVAL") for value in seen.values()), seen

    def test_double_fork_burner_dies_with_the_run(self, box: Sandbox) -> None:
        def burner(token: str, then: str) -> str:
            return f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sh", ["sh", "-c", "while :; do :; done", "burner-{token}"])
    os._exit(0)
os.wait()
print("parent", flush=True)
{then}
"""

        def burners_on_host(token: str) -> list[str]:
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if token.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                        found.append(pid)
                except OSError:
                    pass
            return found

        left_early, killed = secrets.token_hex(8), secrets.token_hex(8)
        # The parent leaves at once: the burner dies with the container's PID namespace.
        result = box.run(burner(left_early, ""), timeout_s=30)
        assert result.ok and not result.timed_out and result.stdout == "parent\n", result.summary()
        # The parent stays: the wall clock kills the container, burner included.
        result = box.run(burner(killed, "time.sleep(600)"), timeout_s=2)
        assert result.timed_out and not result.ok and result.stdout == "parent\n", result.summary()
        assert burners_on_host(left_early) == [] and burners_on_host(killed) == []
        client = docker.DockerClient(base_url=box.engine_url)
        try:
            assert client.containers.list(all=True, filters={"label": "relax_gym.sandbox=1"}) == []
        finally:
            client.close()

    def test_inode_flood_is_contained(self, box: Sandbox) -> None:
        code = """
import errno, os
n = 0
try:
    while True:
        os.close(os.open(f"/scratch/{n}", os.O_CREAT | os.O_WRONLY, 0o600))
        n += 1
except OSError as exc:
    print("stopped", errno.errorcode.get(exc.errno), flush=True)
"""
        # Inodes are kernel memory charged to the container's cgroup: the memory limit or the
        # tmpfs's inode count ends the flood, or the wall clock does on a very slow machine.
        result = box.run(code, timeout_s=60)
        assert result.oom_killed or result.timed_out or "stopped ENOSPC" in result.stdout, result.summary()
        assert box.run("import os; print(os.listdir('/scratch'))").stdout == "[]\n"  # the next run starts clean

    def test_non_utf8_output_is_read_safely(self, box: Sandbox) -> None:
        code = r"""
import os, sys
os.write(1, b"before \xff\xfe\x80 \xed\xa0\x80 after\n")
os.write(2, b"err \xc3\x28 \x00 \x1b[31mred\x1b[0m\n")
sys.stdout.buffer.write(b"cut in the middle \xe2\x82")
"""
        result = box.run(code)
        assert result.ok, result.summary()
        assert result.stdout.startswith("before \ufffd\ufffd\ufffd ") and " after\n" in result.stdout
        assert result.stdout.endswith("cut in the middle \ufffd")
        assert result.stderr.startswith("err \ufffd( \x00 ")
        for text in (result.stdout, result.stderr, result.summary()):
            text.encode("utf-8")  # valid text all the way: no lone surrogates


@pytest.fixture(scope="module")
def surfaces(box: Sandbox) -> dict:
    """bpf, perf_event_open, userfaultfd, keyrings, io_uring, personality and host-only calls, in one run."""
    body = r"""
# Each with arguments that work outside a seccomp filter (for a process of this user), so only
# the filter can explain a refusal.
import struct
prog = (ctypes.c_uint64 * 2)(0xB7, 0x95)  # r0 = 0; exit
license = ctypes.create_string_buffer(b"GPL")
attr = ctypes.create_string_buffer(128)  # BPF_PROG_TYPE_SOCKET_FILTER, 2 instructions, insns, license
struct.pack_into("IIQQ", attr, 0, 1, 2, ctypes.addressof(prog), ctypes.addressof(license))
results["bpf prog load"] = sys_("bpf", 5, attr, 128)  # BPF_PROG_LOAD
attr = ctypes.create_string_buffer(128)  # BPF_MAP_TYPE_ARRAY of 1 entry, 4-byte keys, 8-byte values
struct.pack_into("IIII", attr, 0, 2, 4, 8, 1)
results["bpf map create"] = sys_("bpf", 0, attr, 128)  # BPF_MAP_CREATE
perf = ctypes.create_string_buffer(128)  # PERF_TYPE_SOFTWARE, size, PERF_COUNT_SW_CPU_CLOCK, user space only
struct.pack_into("IIQ", perf, 0, 1, 128, 0)
struct.pack_into("Q", perf, 40, 0x60)  # exclude_kernel | exclude_hv
results["perf_event_open"] = sys_("perf_event_open", perf, 0, -1, -1, 0)  # its own CPU clock
results["userfaultfd"] = sys_("userfaultfd", os.O_CLOEXEC | os.O_NONBLOCK)
results["userfaultfd user-mode"] = sys_("userfaultfd", 1 | os.O_CLOEXEC)  # UFFD_USER_MODE_ONLY
results["keyctl session keyring"] = sys_("keyctl", 0, -3, 1)  # KEYCTL_GET_KEYRING_ID, session, create
results["keyctl join"] = sys_("keyctl", 1, 0)  # KEYCTL_JOIN_SESSION_KEYRING
results["add_key"] = sys_("add_key", b"user", b"relax", b"secret", 6, -2)  # process keyring
results["request_key"] = sys_("request_key", b"user", b"relax", 0, -2)
params = (ctypes.c_uint8 * 120)()
results["io_uring_setup"] = sys_("io_uring_setup", 8, ctypes.byref(params))
results["io_uring_enter"] = sys_("io_uring_enter", 0, 1, 0, 0, 0, 0)
results["io_uring_register"] = sys_("io_uring_register", 0, 0, 0, 0)
# personality: ask (0xffffffff), the default persona, then the ones that change something.
results["personality query"] = sys_("personality", 0xFFFFFFFF)
results["personality PER_LINUX"] = sys_("personality", 0)
results["personality ADDR_NO_RANDOMIZE"] = in_child(sys_, "personality", 0x0040000)
results["personality PER_LINUX32"] = in_child(sys_, "personality", 0x0008)
results["personality READ_IMPLIES_EXEC"] = in_child(sys_, "personality", 0x0400000)
libc.personality.argtypes = [ctypes.c_ulong]
results["glibc personality query"] = libc.personality(0xFFFFFFFF)
proc = subprocess.run(["setarch", platform.machine(), "-R", "cat", "/proc/self/personality"],
                      capture_output=True, text=True)
results["setarch -R"] = [proc.returncode, proc.stdout.strip(), proc.stderr.strip()]
results["personality after"] = open("/proc/self/personality").read().strip()
# Calls the host keeps to itself: refused too (most would also fail for lack of a capability).
for name, args in [("kexec_load", (0, 0, 0, 0)), ("init_module", (0, 0, b"")), ("finit_module", (0, b"", 0)),
                   ("delete_module", (b"loop", 0)), ("reboot", (0xFEE1DEAD, 672274793, 0x4321FEDC, 0)),
                   ("swapon", (b"/scratch/swap", 0)), ("swapoff", (b"/scratch/swap",)), ("acct", (b"/scratch/acct",)),
                   ("settimeofday", (0, 0)), ("clock_settime", (0, 0)), ("quotactl", (0, b"/", 0, 0)),
                   ("fanotify_init", (0, 0)), ("open_by_handle_at", (-100, 0, 0)),
                   ("name_to_handle_at", (-100, b"/", 0, 0, 0))]:
    results[name] = sys_(name, *args)
"""
    return probe(box, body)


@pytest.mark.container
class TestKernelSurfaces:
    """One run of `surfaces`: each of these calls is refused before the kernel acts on it."""

    def test_bpf_is_refused(self, surfaces: dict) -> None:
        assert (surfaces["bpf prog load"], surfaces["bpf map create"]) == (DENIED, DENIED)

    def test_perf_event_open_is_refused(self, surfaces: dict) -> None:
        assert surfaces["perf_event_open"] == DENIED

    def test_userfaultfd_is_refused(self, surfaces: dict) -> None:
        assert (surfaces["userfaultfd"], surfaces["userfaultfd user-mode"]) == (DENIED, DENIED)

    def test_keyring_is_refused(self, surfaces: dict) -> None:
        keyring = {key: surfaces[key] for key in ("keyctl session keyring", "keyctl join", "add_key", "request_key")}
        assert keyring == dict.fromkeys(keyring, DENIED)

    def test_io_uring_is_refused(self, surfaces: dict) -> None:
        uring = {key: surfaces[key] for key in ("io_uring_setup", "io_uring_enter", "io_uring_register")}
        assert uring == dict.fromkeys(uring, DENIED)

    def test_personality_stays_default(self, surfaces: dict) -> None:
        assert surfaces["personality query"] == 0 and surfaces["personality PER_LINUX"] == 0
        assert surfaces["glibc personality query"] == 0
        for persona in ("ADDR_NO_RANDOMIZE", "PER_LINUX32", "READ_IMPLIES_EXEC"):
            assert surfaces[f"personality {persona}"] == "ENOSYS", (persona, surfaces[f"personality {persona}"])
        code, out, err = surfaces["setarch -R"]
        assert code != 0 and out == "" and "Function not implemented" in err, surfaces["setarch -R"]
        assert surfaces["personality after"] == "00000000"

    def test_host_only_calls_are_refused(self, surfaces: dict) -> None:
        host_only = ("kexec_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff")
        host_only += ("acct", "settimeofday", "clock_settime", "quotactl", "fanotify_init", "open_by_handle_at")
        host_only += ("name_to_handle_at",)
        refused = {name: surfaces[name] for name in host_only}
        assert refused == dict.fromkeys(host_only, DENIED)


@pytest.mark.container
class TestProfileIsEnforced:
    def test_engine_that_does_not_apply_the_profile_is_refused(self, box: Sandbox, monkeypatch) -> None:
        # A real engine and container, with the profile swapped for no filter at all: the probe
        # run sees unshare succeed, and construction fails instead of running code unprotected.
        monkeypatch.setattr(container_mod, "_ENFORCED", {})
        monkeypatch.setattr(
            container_mod.ContainerBackend,
            "_seccomp_candidates",
            lambda self, reasons: iter([("no filter", "seccomp=unconfined")]),
        )
        with pytest.raises(SandboxUnavailableError, match=r"would not apply.*unshare\(CLONE_NEWUSER\)"):
            Sandbox(SandboxConfig(require_container=True))

    def test_runs_carry_the_profile(self, box: Sandbox) -> None:
        option = box._backend.security_opt
        assert option.startswith("seccomp=")
        value = option.removeprefix("seccomp=")
        profile = Path(value).read_text() if value.startswith("/") else value
        assert json.loads(profile) == seccomp.profile()
        client = docker.DockerClient(base_url=box.engine_url)
        try:
            created = client.containers.create(
                box.config.image, ["true"], **container_mod._create_kwargs(box.config, option)
            )
            try:
                assert option in created.attrs["HostConfig"]["SecurityOpt"]
                assert "no-new-privileges" in created.attrs["HostConfig"]["SecurityOpt"]
            finally:
                created.remove(force=True)
        finally:
            client.close()


class TestProfile:
    """The profile itself, no engine needed."""

    def test_allowed_and_denied_do_not_overlap(self) -> None:
        allowed, denied = set(seccomp.allowed_names()), set(seccomp.denied_names())
        assert not allowed & denied
        by_argument = {"clone", "clone3", "socket", "socketpair", "personality"}
        assert not by_argument & (allowed | denied)
        for name in ("unshare", "setns", "mount", "bpf", "perf_event_open", "userfaultfd", "keyctl", "ptrace"):
            assert name in denied
        assert {"io_uring_setup", "io_uring_enter", "io_uring_register", "pidfd_getfd", "kcmp"} <= denied

    def test_shape(self) -> None:
        profile = seccomp.profile()
        assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile["defaultErrnoRet"] == errno.ENOSYS
        archs = {entry["architecture"] for entry in profile["archMap"]}
        assert {"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"} <= archs
        assert all(entry["subArchitectures"] == [] for entry in profile["archMap"])
        clone = [rule for rule in profile["syscalls"] if rule["names"] == ["clone"]]
        allow = [rule for rule in clone if rule["action"] == "SCMP_ACT_ALLOW"]
        assert allow == [
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": 0x7E020000, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
                "comment": "threads and fork",
            }
        ]
        # Every rule compares each argument at most once (libseccomp would not AND two).
        for rule in profile["syscalls"]:
            indexes = [arg["index"] for arg in rule["args"]]
            assert len(indexes) == len(set(indexes)), rule
        assert json.loads(seccomp.profile_json()) == profile

    def test_profile_file_is_content_addressed(self, tmp_path: Path, monkeypatch) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
        path = seccomp.profile_path()
        assert path.parent == tmp_path / "relax_gym" / "seccomp"
        assert path.name == seccomp.digest() + ".json"
        assert path.read_text() == seccomp.profile_json()
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        path.write_text("{}")  # tampered or stale: written again
        assert seccomp.profile_path() == path and path.read_text() == seccomp.profile_json()
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp files left

    def test_profile_folder_others_can_write_is_not_used(self, tmp_path: Path, monkeypatch) -> None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        folder = tmp_path / "cache" / "relax_gym" / "seccomp"
        folder.mkdir(parents=True)
        folder.chmod(0o777)
        monkeypatch.setattr(seccomp.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
        path = seccomp.profile_path()
        assert path.parent == tmp_path / "tmp" / f"relax_gym-seccomp-{os.getuid()}"

    def test_a_container_without_the_profile_is_not_run(self) -> None:
        created = SimpleNamespace(short_id="abc", attrs={"HostConfig": {"SecurityOpt": ["no-new-privileges"]}})
        with pytest.raises(SandboxError, match="dropped the seccomp profile"):
            container_mod._check_seccomp(created, ["no-new-privileges", "seccomp=/x.json"])
        kept_as_json = {"HostConfig": {"SecurityOpt": ["seccomp=" + json.dumps(seccomp.profile(), indent=1)]}}
        container_mod._check_seccomp(
            SimpleNamespace(short_id="abc", attrs=kept_as_json), ["seccomp=" + seccomp.profile_json()]
        )
