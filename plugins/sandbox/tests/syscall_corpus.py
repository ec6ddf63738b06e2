# ruff: noqa: E501 -- programs as a model writes them, one statement a line
"""Code of the kind a model writes for a Python tool: what the sandbox's syscall allow-list
must let through. ``scripts/measure_syscalls.py`` runs each program under ``strace`` to list
the syscalls it makes (that is how the allow-list in ``laminar_sandbox/seccomp.py`` was
measured), and ``tests/test_seccomp.py`` runs each in the sandbox: every one must print
``OK`` and nothing else must fail.
"""

PROGRAMS: dict[str, str] = {
    "arithmetic": "print(sum(i * i for i in range(10**5)), 2**100, 7 / 3)\nprint('OK')",
    "stdlib": """
import collections, itertools, functools, fractions, decimal, statistics, math, cmath
import json, re, random, heapq, bisect, string, textwrap, datetime, time, calendar
import hashlib, hmac, secrets, base64, binascii, struct, array, copy, pickle, pprint
import zlib, bz2, lzma, gzip, io, csv, enum, dataclasses, typing, operator, uuid
random.seed(1)
c = collections.Counter(random.choice("abc") for _ in range(100))
print(c.most_common(1), fractions.Fraction(3, 9), decimal.Decimal("1.1") * 3)
print(statistics.mean([1, 2, 3]), math.comb(10, 3), cmath.sqrt(-1))
print(uuid.uuid4().version)
print(hashlib.sha256(b"x").hexdigest()[:8], secrets.token_hex(4) != "", time.time() > 0)
print(len(lzma.compress(b"x" * 1000)), len(bz2.compress(b"y")), len(gzip.compress(b"z")))
print(datetime.datetime.now().year > 2000, pickle.loads(pickle.dumps({1: [2]})))
print('OK')
""",
    "numpy": """
import numpy as np
a = np.random.default_rng(0).random((200, 200))
b = a @ a.T
w = np.linalg.eigvalsh(b)
x = np.linalg.solve(b + np.eye(200), np.ones(200))
f = np.fft.fft(np.arange(64))
print(round(float(w[-1]), 3) > 0, x.shape, abs(f[0]), np.sort(np.array([3, 1, 2])))
np.save("/tmp/a.npy", a)
print(np.load("/tmp/a.npy").shape)
print('OK')
""",
    "sympy": """
import sympy as sp
x, y = sp.symbols("x y")
print(sp.solve(x**2 - 5*x + 6, x), sp.factorint(2**20 - 1))
print(sp.integrate(sp.sin(x)**2, x))
print(sp.simplify((x**2 - 1) / (x - 1)), sp.nsimplify(0.125), sp.isprime(10**9 + 7))
print(sp.Matrix([[1, 2], [3, 4]]).det(), sp.series(sp.exp(x), x, 0, 4))
print(sp.limit(sp.sin(x)/x, x, 0))
print(sp.binomial(50, 25), sp.nextprime(1000), sp.Rational(1, 3) + sp.Rational(1, 6))
print('OK')
""",
    "files": """
import os, shutil, tempfile, pathlib, glob, fnmatch
os.makedirs("/tmp/d/e", exist_ok=True)
with open("/tmp/d/f.txt", "w") as f:
    f.write("hello\\n" * 100)
with open("/tmp/d/f.txt") as f:
    print(len(f.readlines()))
shutil.copy("/tmp/d/f.txt", "/tmp/d/g.txt")
shutil.copytree("/tmp/d", "/tmp/d2")
os.rename("/tmp/d/g.txt", "/tmp/d/h.txt")
os.chmod("/tmp/d/h.txt", 0o600)
os.symlink("/tmp/d/h.txt", "/tmp/d/link")
os.link("/tmp/d/h.txt", "/tmp/d/hard")
print(os.readlink("/tmp/d/link"), os.stat("/tmp/d/h.txt").st_size, os.path.exists("/tmp/d/hard"))
print(sorted(os.listdir("/tmp/d")), sorted(glob.glob("/tmp/d/*.txt")), list(os.walk("/tmp/d2"))[0][2])
with tempfile.NamedTemporaryFile("w", delete=True) as t:
    t.write("x")
    t.flush()
    os.fsync(t.fileno())
with tempfile.TemporaryDirectory() as td:
    pathlib.Path(td, "p").write_text("q")
    print(pathlib.Path(td, "p").read_text())
os.truncate("/tmp/d/h.txt", 3)
os.utime("/tmp/d/h.txt", (1, 1))
shutil.rmtree("/tmp/d")
shutil.rmtree("/tmp/d2")
print(os.getcwd(), os.path.expanduser("~"), os.access("/tmp", os.W_OK), shutil.disk_usage("/tmp").total > 0)
print('OK')
""",
    "processes": """
import os, subprocess, sys
print(subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip())
print(subprocess.check_output(["echo", "hi"], text=True).strip())
print(subprocess.run("ls / | head -3 | wc -l", shell=True, capture_output=True, text=True).stdout.strip())
print(os.system("true"))
with os.popen("echo popen") as p:
    print(p.read().strip())
pid = os.fork()
if pid == 0:
    os._exit(3)
print(os.waitpid(pid, 0)[1] >> 8)
print(os.getpid() > 0, os.getppid() >= 0, os.getuid() > 0, os.cpu_count() >= 1, len(os.sched_getaffinity(0)) >= 1)
print('OK')
""",
    "threads": """
import threading, concurrent.futures, queue, time
q = queue.Queue()
ts = [threading.Thread(target=lambda i=i: q.put(i * i)) for i in range(8)]
[t.start() for t in ts]
[t.join() for t in ts]
print(sorted(q.get() for _ in range(8)))
with concurrent.futures.ThreadPoolExecutor(4) as ex:
    print(list(ex.map(lambda v: v + 1, range(5))))
lock, ev = threading.Lock(), threading.Event()
with lock:
    pass
threading.Timer(0.01, ev.set).start()
print(ev.wait(5))
time.sleep(0.01)
print('OK')
""",
    "multiprocessing": """
import multiprocessing as mp
from multiprocessing import shared_memory

def square(v):
    return v * v

if __name__ == "__main__":
    # (spawn would re-import __main__, which code run from a string does not have)
    with mp.get_context("fork").Pool(2) as pool:
        print(pool.map(square, range(5)))
    q = mp.Queue()
    p = mp.Process(target=q.put, args=(42,))
    p.start()
    print(q.get(timeout=30))
    p.join()
    shm = shared_memory.SharedMemory(create=True, size=1024)
    shm.buf[:3] = b"abc"
    print(bytes(shm.buf[:3]))
    shm.close()
    shm.unlink()
    with mp.Manager() as m:
        d = m.dict(a=1)
        print(dict(d))
    print('OK')
""",
    "concurrent_processes": """
import concurrent.futures

def cube(v):
    return v ** 3

if __name__ == "__main__":
    with concurrent.futures.ProcessPoolExecutor(2) as ex:
        print(list(ex.map(cube, range(4))))
    print('OK')
""",
    "asyncio_and_sockets": """
import asyncio, socket, selectors, select

async def main():
    async def handle(r, w):
        w.write((await r.readline()).upper())
        await w.drain()
        w.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"ping\\n")
    print((await r.readline()).decode().strip())
    w.close()
    server.close()
    await server.wait_closed()
    await asyncio.sleep(0.01)
    proc = await asyncio.create_subprocess_exec("echo", "sub", stdout=asyncio.subprocess.PIPE)
    print((await proc.communicate())[0].decode().strip())

asyncio.run(main())
a, b = socket.socketpair()
a.sendall(b"x")
print(b.recv(1))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("127.0.0.1", 0))
u.sendto(b"d", u.getsockname())
print(u.recvfrom(10)[0])
s6 = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s6.close()
print(select.select([b], [], [], 0), selectors.DefaultSelector().__class__.__name__)
print(socket.gethostname())
print('OK')
""",
    "signals_and_time": """
import signal, time, resource, os, sys, faulthandler, gc, weakref, tracemalloc
signal.signal(signal.SIGALRM, lambda *a: print("alarm"))
signal.setitimer(signal.ITIMER_REAL, 0.01)
time.sleep(0.05)
signal.alarm(0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0, resource.getrlimit(resource.RLIMIT_AS)[0] > 0)
print(time.perf_counter() > 0, time.process_time() >= 0, time.monotonic() > 0, time.thread_time() >= 0)
faulthandler.enable()
tracemalloc.start(); x = [0] * 1000; print(tracemalloc.get_traced_memory()[0] > 0); tracemalloc.stop()
print(gc.collect() >= 0, sys.getrecursionlimit(), os.times().elapsed != 0)
try:
    raise ValueError("shown")
except ValueError as e:
    print(repr(e))
print('OK')
""",
    "ctypes_mmap_sqlite": """
import ctypes, mmap, sqlite3, os
cb = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda v: v + 1)
print(cb(41), ctypes.CDLL(None).getpid() == os.getpid())
m = mmap.mmap(-1, 4096)
m[:2] = b"hi"
m.flush()
print(m[:2])
db = sqlite3.connect(":memory:")
db.execute("create table t(x)")
db.executemany("insert into t values (?)", [(i,) for i in range(10)])
print(db.execute("select sum(x) from t").fetchone())
db2 = sqlite3.connect("/tmp/db.sqlite")
db2.execute("create table u(y)")
db2.commit()
db2.close()
print('OK')
""",
    "os_calls": """
import os, fcntl, signal, socket, subprocess, resource, threading, time
os.chdir("/tmp"); fd = os.open("/tmp", os.O_RDONLY); os.fchdir(fd); os.close(fd)
print(oct(os.umask(0o027)), os.getpgid(0), os.getsid(0), os.getgroups(), os.getresuid()[0] > 0, os.getresgid()[0] > 0)
os.setpgid(0, 0)
p = subprocess.Popen(["sleep", "0.01"], start_new_session=True)
print(os.waitid(os.P_PID, p.pid, os.WEXITED).si_status)
os.sched_yield()
print(os.sched_getparam(0).sched_priority, os.sched_get_priority_max(os.SCHED_FIFO), os.sched_getscheduler(0))
os.sched_setaffinity(0, os.sched_getaffinity(0))
print(os.getpriority(os.PRIO_PROCESS, 0)); os.nice(1)
r, w = os.pipe()
os.writev(w, [b"ab", b"cd"]); print(os.readv(r, [bytearray(4)]))
a, b = socket.socketpair()
socket.send_fds(a, [b"m"], [r]); msg, fds, _, _ = socket.recv_fds(b, 1, 1); print(msg, len(fds))
a.shutdown(socket.SHUT_RDWR)
with open("/tmp/lock", "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX); fcntl.lockf(f, fcntl.LOCK_UN)
    os.posix_fallocate(f.fileno(), 0, 4096)
    print(os.fstatvfs(f.fileno()).f_bsize > 0, os.listxattr("/tmp/lock"))
with open("/tmp/src", "wb") as src, open("/tmp/dst", "wb") as dst:
    src.write(b"x" * 100); src.flush()
    print(os.copy_file_range(os.open("/tmp/src", os.O_RDONLY), dst.fileno(), 100))
signal.signal(signal.SIGUSR1, lambda *a: print("usr1"))
signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
print(signal.sigtimedwait([signal.SIGUSR2], 0), signal.getitimer(signal.ITIMER_REAL))
print(signal.sigpending(), resource.setrlimit(resource.RLIMIT_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)))
time.sleep(0.001)
print('OK')
""",
    "big_allocation": """
try:
    x = bytearray(20 * 1024**3)
except MemoryError:
    print("MemoryError")
y = bytearray(50 * 1024**2)
print(len(y))
print('OK')
""",
}
