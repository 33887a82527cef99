"""Carry Triton's compiled kernels from one device call to the next, so that its device time runs kernels rather than
compiles.

A lent machine starts with an empty Triton cache, and compiling this package's kernels there costs minutes of a
session's device time (session 31: the GPU suite compiled 955 kernels, and its largest test was still compiling when
a 230 s cap cut it off). Triton's cache key is made of the kernel's source and specialisation, the target, the
compiler build (a hash of the installed Triton, its ``libtriton`` binary included) and the options; the machine's
name and the cache's path play no part. So the kernels one call compiled are the entries the next call looks up, on
any machine with the same Triton install.

- ``export CACHE BUNDLE``: pack a cache directory's kernels into one ``.tar.xz``, each kernel's metadata and binary
  (cubin) only. The IR files (TTIR, TTGIR, LLVM IR, PTX) are what make a cache large, and launching needs none of them.
- ``install BUNDLE``: unpack into this machine's cache (``TRITON_CACHE_DIR``, else ``~/.triton/cache``), rewriting each
  kernel's group file: Triton records absolute paths there. Kernels already in the cache are left as they are. The
  bundle is read once, front to back (an ``.xz`` stream cannot seek back without decompressing again from its start:
  session 31's first version did that per kernel and took 101 s for 330 kernels, minutes for 708).
- ``count``: the kernels in the cache. Counted before and after a run, it says how many the run compiled anew.

Two ways to fill a bundle, both carried in ``.base`` (which travels with ``carry``):

1. End each device call by exporting that machine's cache, and start the next by installing it:

       python benchmarks/triton_cache.py install .base/triton-gpu.tar.xz       # first, in the call
       ...                                                                     # tests, benchmarks
       python benchmarks/triton_cache.py export ~/.triton/cache $OUT/triton-gpu.tar.xz   # last; copy it to .base/

   The device returns files of at most 16 MiB: ``--skip`` the bundles the call installed (only what it compiled
   itself travels back) and ``--max-mib 15`` (parts ``triton-gpu-2.tar.xz``, ...; the limit counts uncompressed
   bytes, so a part is smaller still). Session 33's whole cache, 2,128 kernels, packed to 39 MiB and was lost.

2. Compile here, for sm_90, under the GPU image's keys. Triton's key hashes its ``libtriton`` binary, which differs
   between the wheels of one Triton version for two Pythons (the lent image runs Python 3.12, this machine 3.11):
   ``kernel_resources.py --key-as-wheel`` compiles with that one hash swapped for the image's wheel's
   (:func:`keyed_as`; session 31: 6 of 6 kernels compiled so here were in the cache the GPU machine exported; without
   the swap no key can match, the two binaries hashing differently):

       pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_27_x86_64 \
           --platform manylinux_2_28_x86_64 triton==3.6.0 -d /tmp/tw          # 188 MB: keep it out of .base
       TRITON_CACHE_DIR=/tmp/tc python benchmarks/kernel_resources.py --n 16384 --key-as-wheel /tmp/tw/triton-*.whl
       python benchmarks/triton_cache.py export /tmp/tc .base/triton-sm90.tar.xz

   The drive runs the benchmarks' shapes and paths (9-10 minutes on 2 cores), not the GPU tests' odd lengths.
   ``--n 16384`` specialises as longer lengths mostly do (Triton specialises integers equal to 1 or divisible by 16),
   and 64K does not fit a 24 GiB machine: the recorded launches keep their tensors.

A bundle's kernels carry no PTX, so ``kernel_resources.py`` (which reads the PTX) cannot run against a cache they were
installed into."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import sys
import sysconfig
import tarfile
import zipfile

BINARIES = (".cubin", ".hsaco")  # what a launch loads, per backend
GROUP = "__grp__"


def cache_dir(path: str | None = None) -> str:
    """The Triton cache this process uses: ``path``, else ``TRITON_CACHE_DIR``, else ``~/.triton/cache``."""
    return path or os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def _sha256(stream) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: stream.read(2**20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def libtriton_hash(wheel: str) -> str:
    """The hash Triton's cache key takes of the ``libtriton`` binary in ``wheel``: a ``.whl`` of the installed Triton's
    version, built for another Python (``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
    manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 triton==3.6.0``)."""
    import triton

    name = os.path.basename(wheel)
    if not (name.startswith("triton-") and name.endswith(".whl")) or not os.path.isfile(wheel):
        raise ValueError(f"wheel: {wheel!r} is not a Triton wheel file (triton-<version>-...whl)")
    if name.split("-")[1] != triton.__version__:
        raise ValueError(f"wheel: {wheel!r} is Triton {name.split('-')[1]}, the installed Triton is "
                         f"{triton.__version__}: only the same version compiles the same kernels")
    with zipfile.ZipFile(wheel) as z:
        inside = [n for n in z.namelist() if n.startswith("triton/_C/libtriton.")]
        if len(inside) != 1:
            raise ValueError(f"wheel: {wheel!r} holds {len(inside)} triton/_C/libtriton.* files, not one")
        with z.open(inside[0]) as f:
            return _sha256(f)


@contextlib.contextmanager
def keyed_as(theirs: str | None):
    """Inside the block, Triton's cache keys as the Triton whose ``libtriton`` binary hashes to ``theirs``
    (:func:`libtriton_hash`) computes them; ``None``: unchanged.

    Why: Triton's key hashes its own files, and between the wheels of one version for two Pythons only the
    ``libtriton`` binary differs (the Python files are the same), so a kernel compiled here with that one hash swapped
    lands under the key the other build looks up (session 31: a kernel compiled so here, Python 3.11, was in the cache
    the lent GPU image, Python 3.12, had exported; without the swap none is)."""
    if theirs is None:
        yield
        return
    import triton
    import triton.runtime.cache as triton_cache_module

    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]  # as triton_key() finds its own binary
    with open(os.path.join(os.path.dirname(triton.__file__), "_C", f"libtriton.{ext}"), "rb") as f:
        mine = _sha256(f)
    real = triton_cache_module.triton_key
    own = real()
    if mine not in own:
        raise RuntimeError(f"Triton {triton.__version__} computes its cache key without its libtriton hash: "
                           "keyed_as does not know how to stand in for another build")
    triton_cache_module.triton_key = lambda: own.replace(mine, theirs)
    try:
        yield
    finally:
        triton_cache_module.triton_key = real


def _groups(root: str):
    """``(key, group name, {child name: absolute path})`` of every kernel group under a cache directory."""
    if not os.path.isdir(root):
        raise ValueError(f"cache: {root!r} is not a directory")
    for key in sorted(os.listdir(root)):
        d = os.path.join(root, key)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            if name.startswith(GROUP) and name.endswith(".json"):
                with open(os.path.join(d, name)) as f:
                    children = json.load(f).get("child_paths")
                if isinstance(children, dict):
                    yield key, name, children


def count(root: str | None = None) -> int:
    """How many compiled kernels (groups with a binary) the cache holds."""
    root = cache_dir(root)
    if not os.path.isdir(root):
        return 0
    return sum(1 for _, _, children in _groups(root) if any(c.endswith(BINARIES) for c in children))


def bundle_keys(bundle: str) -> set[str]:
    """The cache keys (kernel directories) whose group file ``bundle`` holds, read as a stream."""
    if not os.path.isfile(bundle):
        raise ValueError(f"skip: {bundle!r} is not a file")
    with tarfile.open(bundle, "r|xz") as tar:
        return {os.path.dirname(m.name) for m in tar if os.path.basename(m.name).startswith(GROUP)}


def _part(bundle: str, i: int) -> str:
    """The ``i``-th part's path: ``bundle`` itself, then ``NAME-2.tar.xz``, ``NAME-3.tar.xz``..."""
    return bundle if i == 1 else f"{bundle[:-len('.tar.xz')]}-{i}.tar.xz"


def export(src: str, bundle: str, skip=(), max_bytes: int | None = None) -> tuple[int, int, list[str]]:
    """Pack every kernel of cache ``src`` (metadata and binary) into ``bundle`` (``.tar.xz``), each group file
    listing its children by name. ``skip``: bundles whose kernels are left out (those a call installed, so that its
    export holds only what it compiled itself). ``max_bytes``: start a new part (``NAME-2.tar.xz``, ...) before a part's
    uncompressed kernels would pass it, so that no part outgrows a file-size limit (the device's 16 MiB a returned
    file: session 33's whole-cache export, 39 MiB, was lost). Returns ``(kernels, bytes written, parts)``."""
    if not bundle.endswith(".tar.xz"):
        raise ValueError(f"bundle: {bundle!r} must end in .tar.xz")
    if not os.path.isdir(src):  # before the bundle is opened: a bad cache path writes nothing
        raise ValueError(f"cache: {src!r} is not a directory")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes (--max-mib) must be positive, got {max_bytes}")
    skipped = set().union(*(bundle_keys(b) for b in skip)) if skip else set()
    os.makedirs(os.path.dirname(os.path.abspath(bundle)), exist_ok=True)
    n, parts, tar, raw = 0, [], None, 0
    try:
        for key, name, children in _groups(src):
            keep = {c: p for c, p in children.items() if c.endswith(".json") or c.endswith(BINARIES)}
            if key in skipped or not any(c.endswith(BINARIES) for c in keep) or not all(
                    os.path.exists(p) for p in keep.values()):
                continue  # already carried, or a failed or partial compile: nothing a launch could load
            size = sum(os.path.getsize(p) for p in keep.values())
            if tar is None or (max_bytes is not None and raw and raw + size > max_bytes):
                if tar is not None:
                    tar.close()
                parts.append(_part(bundle, len(parts) + 1))
                tar, raw = tarfile.open(parts[-1], "w:xz"), 0
            for child, path in keep.items():
                tar.add(path, arcname=f"{key}/{child}")
            data = json.dumps({"child_paths": sorted(keep)}).encode()
            info = tarfile.TarInfo(f"{key}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            raw += size
            n += 1
        if tar is None:  # nothing to carry: still one (empty) bundle, so that a script's next step finds it
            parts.append(bundle)
            tar = tarfile.open(bundle, "w:xz")
    finally:
        if tar is not None:
            tar.close()
    return n, sum(os.path.getsize(p) for p in parts), parts


def install(bundle: str, dst: str | None = None) -> int:
    """Unpack ``bundle`` into cache ``dst`` (``cache_dir``), each group file pointing at its children's new absolute
    paths; kernels whose group the cache already has are skipped. Returns how many were added."""
    dst = cache_dir(dst)
    if not os.path.isfile(bundle):
        raise ValueError(f"bundle: {bundle!r} is not a file")
    added = 0
    groups, files = [], {}
    with tarfile.open(bundle, "r|xz") as tar:  # one pass, front to back: a stream refuses to seek back
        for member in tar:
            key, name = os.path.split(member.name)
            if not member.isfile() or os.path.dirname(key) or key in ("", ".", ".."):
                continue
            data = tar.extractfile(member).read()
            if name.startswith(GROUP):
                groups.append((key, name, json.loads(data)["child_paths"]))
            else:
                files[member.name] = data
    for key, name, children in groups:  # every group checked before any is written: a bad bundle installs nothing
        for child in children:
            if os.path.basename(child) != child or f"{key}/{child}" not in files:
                raise ValueError(f"bundle: {bundle!r} names {child!r} in {key}/{name} but does not hold it")
    for key, name, children in groups:
        target = os.path.join(dst, key)
        if os.path.exists(os.path.join(target, name)):
            continue
        os.makedirs(target, exist_ok=True)
        paths = {}
        for child in children:
            with open(os.path.join(target, child), "wb") as f:
                f.write(files[f"{key}/{child}"])
            paths[child] = os.path.join(target, child)
        with open(os.path.join(target, name), "w") as f:  # last: Triton looks for the group file first
            json.dump({"child_paths": paths}, f)
        added += 1
    return added


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="pack a cache's kernels (metadata and binary) into a .tar.xz")
    ex.add_argument("cache")
    ex.add_argument("bundle")
    ex.add_argument("--skip", nargs="+", default=(), metavar="BUNDLE",
                    help="leave out the kernels these bundles hold (export only what this machine compiled)")
    ex.add_argument("--max-mib", type=float, default=None,
                    help="split into parts NAME-2.tar.xz, ... of at most this many MiB of kernels each")
    ins = sub.add_parser("install", help="unpack a bundle into this machine's Triton cache")
    ins.add_argument("bundle")
    ins.add_argument("--cache", help="the cache to fill (default: TRITON_CACHE_DIR, else ~/.triton/cache)")
    cnt = sub.add_parser("count", help="how many compiled kernels a cache holds")
    cnt.add_argument("--cache")
    args = ap.parse_args(argv)
    try:
        if args.command == "export":
            limit = None if args.max_mib is None else int(args.max_mib * 2**20)
            n, size, parts = export(args.cache, args.bundle, args.skip, limit)
            print(f"exported {n} kernels from {args.cache} to {' '.join(parts)} ({size / 2**20:.1f} MiB)")
        elif args.command == "install":
            n = install(args.bundle, args.cache)
            print(f"installed {n} kernels into {cache_dir(args.cache)} ({count(args.cache)} there now)")
        else:
            print(count(args.cache))
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
