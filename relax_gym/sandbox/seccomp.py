"""The seccomp profile every sandbox container runs under, built here and nowhere else.

Why one of our own: podman's default profile (containers/common's seccomp.json)
allows unshare, clone and clone3 with any namespace flag, setns, mount, keyctl,
ptrace and more without any capability. Code in a podman sandbox could make a
user namespace, hold a full capability set inside it, and from there mount
filesystems and make namespaces of every kind, which puts much of the kernel
within reach of untrusted code. Docker's default gates those on CAP_SYS_ADMIN,
but the sandbox should not depend on which engine's default it gets.

**An allowlist**: ``defaultAction`` is an errno, ENOSYS ("not implemented",
which libc and Python treat as "feature absent" and fall back from), and only
what an ordinary program uses is allowed: processes and threads, signals, time,
memory, files, pipes and polling, sockets of four families, SysV/POSIX IPC
(private to the container's IPC namespace). Not a denylist over "allow": that
would let through each syscall the kernel adds after the list was written
(io_uring, userfaultfd and bpf each arrived that way), and a custom profile
*replaces* the engine's default instead of adding to it, so a denylist would
also reopen everything the default had closed. Measured before choosing, with
the default action set to SCMP_ACT_LOG (kernel log, podman 4.3, runc 1.1.5,
libseccomp 2.5.4, Debian's python 3.11 image): threads, subprocess, shell
pipelines and coreutils, multiprocessing (fork, spawn, forkserver, Manager,
shared_memory), concurrent.futures, asyncio (subprocesses, TCP and unix
servers), sqlite3 with WAL, ctypes callbacks, mmap, memfd, eventfd, pidfd, pty,
signals and timers, an import of every stdlib module, and numpy 2 (OpenBLAS
threads, linalg, fft) and sympy mounted in from outside the image logged no
syscall outside the list. tests/sandbox/test_sandbox.py keeps the core of that workload
as test_ordinary_programs_run_under_the_profile.

**Refused with EPERM** (``DENIED``, so the intent is explicit and the answer
is "not permitted", not "not implemented"): making or entering namespaces
(unshare, setns; clone with a CLONE_NEW* flag), the mount family and chroot,
and kernel surfaces that need no capability or that only the host may use:
bpf, perf_event_open, userfaultfd, the keyring, io_uring, fanotify, ptrace and
the cross-process memory/file-descriptor calls, files by handle, and the
kexec/module/reboot/swap/accounting/clock/quota/syslog calls. clone3 answers
ENOSYS instead: its flags are in memory that seccomp cannot read, and glibc
(2.34+) falls back to clone on ENOSYS, where they are an argument it can.

**By argument**: clone without any CLONE_NEW* flag (threads and fork); socket
for AF_UNIX, AF_INET, AF_INET6, and AF_NETLINK with NETLINK_ROUTE only (used
by getaddrinfo and ``socket.if_nameindex``), every other family answering
EAFNOSUPPORT (AF_PACKET, AF_ALG, AF_VSOCK, AF_XDP, ...); socketpair for
AF_UNIX; personality to query or to set the default persona (so no
ADDR_NO_RANDOMIZE: ASLR stays on); other personas answer ENOSYS.

**Architectures**: x86_64 and aarch64, native ABI only. Syscalls are named,
not numbered: the runtime (runc or crun, through libseccomp) resolves each
name for the host's architecture and skips names it lacks there. No
sub-architectures (i386, x32, arm32): their syscalls meet libseccomp's
bad-architecture action and the process is killed with SIGSYS (measured:
``int 0x80`` from an x86_64 process). Listing i386 would be worse than useless:
its socketcall multiplexer hides socket()'s arguments, so libseccomp turns the
family rules into "socketcall allowed" and AF_ALG & co. come back (measured).
The clone filter assumes flags in argument 0, true of both (s390x, where they
are argument 1, is not covered).

The engine gets the profile through ``security_opt`` (see
``relax_gym.sandbox.container``): Docker takes the JSON itself
("seccomp=<json>"); podman's Docker API (4.x) takes a path on the engine's
host, so for podman the profile is written to ``profile_path()``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import tempfile
from functools import cache
from pathlib import Path

# Namespace flags of clone(2)/unshare(2). CLONE_NEWTIME (0x80) is not among
# them: clone() reads its low byte as the exit signal, and a time namespace
# can only be made through unshare or clone3, both refused outright.
CLONE_NAMESPACE_FLAGS: dict[str, int] = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
CLONE_NAMESPACE_MASK = sum(CLONE_NAMESPACE_FLAGS.values())

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
ALLOWED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
NETLINK_ROUTE = 0
# Families below this answer EAFNOSUPPORT unless allowed (the kernel has
# numbers up to AF_MCTP = 45 today); any other value answers ENOSYS.
_AF_MAX = 64
PER_LINUX = 0
PERSONALITY_QUERY = 0xFFFFFFFF

# Native 64-bit ABIs only, no sub-architectures (see the module docstring).
ARCHITECTURES: dict[str, list[str]] = {"SCMP_ARCH_X86_64": [], "SCMP_ARCH_AARCH64": []}


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# What an ordinary program (CPython, its stdlib, a shell and coreutils) uses,
# grouped by what it is for. Names of either architecture: x86_64 keeps legacy
# calls (open, stat, fork, pipe, poll, ...) that aarch64 only has as *at/2 forms.
ALLOWED: dict[str, tuple[str, ...]] = {
    "processes and threads": _names("""
        fork vfork execve execveat exit exit_group wait4 waitid
        set_tid_address set_robust_list get_robust_list rseq arch_prctl prctl
        getpid getppid gettid getpgid setpgid getpgrp getsid setsid
        futex futex_waitv futex_wait futex_wake futex_requeue
        sched_yield sched_getaffinity sched_setaffinity sched_getparam sched_setparam
        sched_getscheduler sched_setscheduler sched_getattr sched_setattr
        sched_get_priority_max sched_get_priority_min sched_rr_get_interval
        getpriority setpriority ioprio_get ioprio_set getcpu
        getrlimit setrlimit prlimit64 getrusage times sysinfo uname
        umask chdir fchdir getcwd pidfd_open pidfd_send_signal
        capget capset seccomp landlock_create_ruleset landlock_add_rule landlock_restrict_self
    """),
    # Without CAP_SETUID/CAP_SETGID the set* calls only switch among ids the process already has.
    "user and group ids": _names("""
        getuid geteuid getgid getegid getresuid getresgid getgroups
        setuid setgid setreuid setregid setresuid setresgid setfsuid setfsgid setgroups
    """),
    "signals": _names("""
        rt_sigaction rt_sigprocmask rt_sigreturn rt_sigpending rt_sigtimedwait rt_sigsuspend
        rt_sigqueueinfo rt_tgsigqueueinfo sigaltstack signalfd signalfd4
        kill tkill tgkill pause alarm restart_syscall
    """),
    "time": _names("""
        clock_gettime clock_getres clock_nanosleep nanosleep gettimeofday time
        timer_create timer_settime timer_gettime timer_getoverrun timer_delete
        getitimer setitimer timerfd_create timerfd_settime timerfd_gettime
    """),
    "memory": _names("""
        brk mmap munmap mremap mprotect madvise msync mincore membarrier
        mlock mlock2 munlock mlockall munlockall mseal map_shadow_stack
        get_mempolicy set_mempolicy mbind pkey_alloc pkey_free pkey_mprotect memfd_create
    """),
    "files": _names("""
        read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2
        open openat openat2 creat close close_range lseek dup dup2 dup3
        fcntl flock ioctl stat fstat lstat newfstatat statx statfs fstatfs
        access faccessat faccessat2 readlink readlinkat getdents getdents64
        mkdir mkdirat rmdir unlink unlinkat rename renameat renameat2
        link linkat symlink symlinkat mknod mknodat
        chmod fchmod fchmodat fchmodat2 chown fchown lchown fchownat
        truncate ftruncate fallocate fadvise64 readahead
        sync fsync fdatasync syncfs sync_file_range
        utime utimes utimensat futimesat
        getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr
        setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr
        sendfile splice tee vmsplice copy_file_range
        inotify_init inotify_init1 inotify_add_watch inotify_rm_watch
    """),
    "pipes and polling": _names("""
        pipe pipe2 eventfd eventfd2 select pselect6 poll ppoll
        epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2
    """),
    # socket and socketpair themselves are allowed by argument, in _argument_rules.
    "sockets": _names("""
        bind listen accept accept4 connect getsockname getpeername shutdown
        sendto recvfrom sendmsg recvmsg sendmmsg recvmmsg setsockopt getsockopt
    """),
    "ipc, in the container's own IPC namespace": _names("""
        shmget shmat shmdt shmctl semget semop semtimedop semctl msgget msgsnd msgrcv msgctl
        mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
    """),
    "randomness": _names("getrandom"),
}

# Refused with EPERM whatever the arguments. Most would fail anyway for a
# process without capabilities; listing them means the kernel code behind
# them is not reached at all, whatever the process managed to become.
DENIED: dict[str, tuple[str, ...]] = {
    "namespaces": _names("unshare setns"),
    "mounts and roots": _names("""
        mount umount umount2 pivot_root chroot
        fsopen fsconfig fsmount fspick move_mount open_tree mount_setattr
    """),
    "kernel surfaces open without a capability": _names("""
        bpf perf_event_open userfaultfd keyctl add_key request_key
        io_uring_setup io_uring_enter io_uring_register fanotify_init fanotify_mark
    """),
    "other processes": _names("ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd"),
    "files by handle": _names("open_by_handle_at name_to_handle_at"),
    "host administration": _names("""
        kexec_load kexec_file_load init_module finit_module delete_module create_module
        reboot swapon swapoff acct settimeofday stime clock_settime clock_adjtime adjtimex
        sethostname setdomainname quotactl quotactl_fd syslog vhangup
        iopl ioperm modify_ldt lookup_dcookie nfsservctl uselib get_kernel_syms query_module _sysctl
        move_pages migrate_pages
    """),
}
DENIED_ERRNO = errno.EPERM
# clone3 keeps its flags in memory seccomp cannot read: "not implemented" makes glibc use clone.
CLONE3_ERRNO = errno.ENOSYS
SOCKET_FAMILY_ERRNO = errno.EAFNOSUPPORT


def allowed_names() -> list[str]:
    return sorted({name for group in ALLOWED.values() for name in group})


def denied_names() -> list[str]:
    return sorted({name for group in DENIED.values() for name in group})


def _arg(index: int, value: int, op: str = "SCMP_CMP_EQ", value_two: int = 0) -> dict:
    return {"index": index, "value": value, "valueTwo": value_two, "op": op}


def _rule(names: list[str], action: str, args: list[dict] | None, comment: str, **extra: int) -> dict:
    rule = {"names": names, "action": action, "args": args or [], **extra}
    return {**rule, "comment": comment} if comment else rule


def _errno(names: list[str], code: int, args: list[dict] | None = None, comment: str = "") -> dict:
    return _rule(names, "SCMP_ACT_ERRNO", args, comment, errnoRet=code)


def _allow(names: list[str], args: list[dict] | None = None, comment: str = "") -> dict:
    return _rule(names, "SCMP_ACT_ALLOW", args, comment)


def _argument_rules() -> list[dict]:
    """clone, clone3, socket, socketpair and personality, whose answer depends on their arguments.

    A rule holds one comparison per argument: a second one on the same argument
    does not AND with the first (measured: "!= 0 and != 0xffffffff" refused
    personality(0)), so "any of these bits" or "none of these values" takes one
    rule per bit or value. Rules of one syscall must not overlap.
    """
    return [
        _allow(["clone"], [_arg(0, CLONE_NAMESPACE_MASK, "SCMP_CMP_MASKED_EQ", 0)], "threads and fork"),
        *(
            _errno(["clone"], DENIED_ERRNO, [_arg(0, flag, "SCMP_CMP_MASKED_EQ", flag)], name)
            for name, flag in CLONE_NAMESPACE_FLAGS.items()
        ),
        _errno(["clone3"], CLONE3_ERRNO, comment="flags are out of seccomp's sight: glibc falls back to clone"),
        _allow(["socket"], [_arg(0, AF_UNIX)]),
        _allow(["socket"], [_arg(0, AF_INET)]),
        _allow(["socket"], [_arg(0, AF_INET6)]),
        _allow(["socket"], [_arg(0, AF_NETLINK), _arg(2, NETLINK_ROUTE)], "interfaces and addresses"),
        _errno(["socket"], SOCKET_FAMILY_ERRNO, [_arg(0, AF_NETLINK), _arg(2, NETLINK_ROUTE, "SCMP_CMP_NE")]),
        *(
            _errno(["socket"], SOCKET_FAMILY_ERRNO, [_arg(0, family)])
            for family in range(_AF_MAX)
            if family not in ALLOWED_FAMILIES
        ),
        _allow(["socketpair"], [_arg(0, AF_UNIX)]),
        # The kernel reads the persona as a 32-bit int: compare those bits only, as it will.
        _allow(["personality"], [_arg(0, 0xFFFFFFFF, "SCMP_CMP_MASKED_EQ", PER_LINUX)], "the default persona"),
        _allow(["personality"], [_arg(0, 0xFFFFFFFF, "SCMP_CMP_MASKED_EQ", PERSONALITY_QUERY)], "query it"),
    ]


def profile() -> dict:
    """The profile as a seccomp JSON object of the OCI/Docker/podman form (a new one per call)."""
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": errno.ENOSYS,
        "archMap": [{"architecture": arch, "subArchitectures": subs} for arch, subs in ARCHITECTURES.items()],
        "syscalls": [
            _allow(allowed_names()),
            _errno(denied_names(), DENIED_ERRNO),
            *_argument_rules(),
        ],
    }


@cache
def profile_json() -> str:
    """The profile serialised deterministically (sorted keys, no spaces): what the engine gets."""
    return json.dumps(profile(), sort_keys=True, separators=(",", ":"))


@cache
def digest() -> str:
    """sha256 of ``profile_json()``: names the file the profile is written to."""
    return hashlib.sha256(profile_json().encode()).hexdigest()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "relax_gym" / "seccomp"


def profile_path() -> Path:
    """Write the profile to a content-addressed file (once, atomically) and return its path.

    For engines that take a path on their own host (podman's Docker API): the
    file lives in the user's cache dir, in a folder only its owner can write,
    named by the profile's digest; a file there that does not hold exactly this
    profile is replaced. Raises OSError when no such folder can be made.
    """
    text = profile_json()
    errors = []
    # The fallback sits right in the sticky temp dir: a folder of ours there cannot be renamed away by others.
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / f"relax_gym-seccomp-{os.getuid()}"):
        try:
            return _write_once(folder, f"{digest()}.json", text)
        except OSError as exc:
            errors.append(f"{folder}: {exc}")
    raise OSError("cannot write the sandbox's seccomp profile: " + "; ".join(errors))


def _write_once(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    # Another user's folder (a planted one under /tmp) could swap the profile after we wrote it.
    if not os.path.isdir(folder) or folder.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise OSError(f"{folder} is not a folder that only this user can write")
    path = folder / name
    try:
        if not path.is_symlink() and path.read_text() == text:
            return path
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
