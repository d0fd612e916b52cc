#!/usr/bin/env python3
"""Whether a change to CUDA sources changes the machine code, checked on a machine without a GPU:
each .cu file is compiled to a cubin (nvcc -cubin, sm_90 by default) as it is at REV and as it is
in the working tree, and every kernel's .text section is compared byte for byte. A refactor of
kernel code (a shared device function, a renamed variable) that leaves every section identical
cannot change a result or a timing; one that does not is reported with the count of differing
instructions, to be run on the device.

    scripts/dev/sass_identical.py [--rev HEAD] [--arch sm_90] FILE.cu...

Prints one line per kernel (identical / DIFFERENT in N of M instructions / only in one version)
and exits 1 where any differs. Needs nvcc (/usr/local/cuda/bin or PATH); the sources are compiled
as the build compiles them (-O3, -DNDEBUG, the repository root on the include path), each REV
file under its own path in a scratch tree so that the anonymous namespaces' names agree."""
import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def nvcc():
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.exists(c):
            return c
    sys.exit("sass_identical: no nvcc (PATH or /usr/local/cuda/bin)")


def text_sections(cubin):
    """{kernel name: its .text bytes} of an ELF64 cubin, anonymous namespaces' hashes removed."""
    b = open(cubin, "rb").read()
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", b, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    out = {}
    for h in headers:
        start = strtab + h[0]
        name = b[start:b.index(b"\0", start)].decode()
        if name.startswith(".text."):
            name = re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+", "(anonymous)", name[6:])
            out[name] = b[h[4]:h[4] + h[5]]
    return out


def compile_cubin(src_root, rel, arch, out):
    cmd = [nvcc(), "-DEXL3_HAVE_CUDA=1", f"-I{src_root}", f"-I{ROOT}", "-O3", "-DNDEBUG", f"-arch={arch}",
           "-std=c++17", "-cubin", rel, "-o", out]
    r = subprocess.run(cmd, cwd=src_root, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"sass_identical: nvcc failed on {rel} in {src_root}:\n{r.stderr}")
    return text_sections(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rev", default="HEAD", help="the version to compare with (default HEAD)")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("files", nargs="+", metavar="FILE.cu")
    args = p.parse_args(argv)
    differs = False
    with tempfile.TemporaryDirectory() as tmp:
        old_root = os.path.join(tmp, "rev")
        for f in args.files:
            rel = os.path.relpath(os.path.abspath(f), ROOT)
            show = subprocess.run(["git", "-C", ROOT, "show", f"{args.rev}:{rel}"], capture_output=True)
            if show.returncode != 0:
                sys.exit(f"sass_identical: {rel} is not in {args.rev}")
            os.makedirs(os.path.join(old_root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(old_root, rel), "wb") as out:
                out.write(show.stdout)
            # The REV file first on the include path: its own directory's headers are still the
            # working tree's (a header change shows as a difference of the files that include it).
            old = compile_cubin(old_root, rel, args.arch, os.path.join(tmp, "old.cubin"))
            new = compile_cubin(ROOT, rel, args.arch, os.path.join(tmp, "new.cubin"))
            for name in sorted(set(old) | set(new)):
                a, b = old.get(name), new.get(name)
                if a is None or b is None:
                    verdict = f"only in {'the working tree' if a is None else args.rev}"
                elif a == b:
                    verdict = "identical"
                else:
                    n = max(len(a), len(b)) // 16
                    d = sum(1 for i in range(0, max(len(a), len(b)), 16) if a[i:i + 16] != b[i:i + 16])
                    verdict = f"DIFFERENT in {d} of {n} instructions"
                differs |= verdict != "identical"
                print(f"{rel} {name}: {verdict}")
    sys.exit(1 if differs else 0)


if __name__ == "__main__":
    main()
