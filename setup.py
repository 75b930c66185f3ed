"""Build script for tf_sparse_split.

Builds two native pieces against the TensorFlow installed in the *current*
environment (its headers, compile and link flags and C++ ABI, read from
``tf.sysconfig``):

* ``tf_sparse_split/_sparse_split_ops*.so`` -- the op library: the
  framework-free kernels (cc/core), the TF op registrations (cc/ops), their
  OpKernels (cc/kernels) and the graph
  rewrite pass (cc/rewrite), loaded with ``tf.load_op_library``;
* ``tf_sparse_split/_kernels*.so`` -- a pybind11 module giving numpy access to
  the cc/core code (no TensorFlow inside).

Install with ``pip install --no-build-isolation .``: build isolation would
download a second TensorFlow (hundreds of MB) into a throwaway environment,
and the library must be built against the TensorFlow it will be loaded into.

Environment variables:

* ``TFSS_MARCH``: the ``-march`` value (default ``native``: the machine that
  builds is the machine that runs; set e.g. ``x86-64-v3`` for a portable
  build). ``TFSS_MARCH=none`` passes no ``-march`` at all.
* ``TFSS_WITH_CUDA``: ``auto`` (default), ``0`` or ``1``. ``auto`` builds the
  CUDA kernels into the op library only when ``nvcc`` is found (``NVCC``,
  else ``PATH``, else ``/usr/local/cuda/bin/nvcc``) AND the installed
  TensorFlow is a CUDA build (``tf.sysconfig.get_build_info()
  ["is_cuda_build"]``); with ``tensorflow-cpu`` it builds CPU-only and says
  so. ``1`` requires both and fails with a message otherwise; ``0`` never
  builds them. A CUDA build compiles ``cc/core/**/*.cu.cc`` and
  ``cc/kernels/**/*.cu.cc`` with nvcc (``-x cu -std=c++17 -O3``, SASS for
  ``TFSS_CUDA_ARCH``, default ``90``, plus ``compute_80`` PTX,
  ``-Xcompiler -fPIC``, TensorFlow's include flags), links the objects and
  ``-lcudart`` into the op library, and compiles its ``.cc`` files with
  ``-DGOOGLE_CUDA=1`` (which enables the GPU kernels in
  ``cc/kernels/*_gpu.cc``). ``CUDA_HOME`` (default: the directory above nvcc's
  ``bin``) gives the CUDA headers and ``libcudart``.
* ``TFSS_BUILD_JOBS``: how many sources compile at once (default: the CPUs
  this process may use). A rebuild in the same folder
  (``python setup.py build_ext --inplace``) recompiles only the sources
  newer than their objects, all of them when a header under ``cc/`` or
  the compiler arguments changed.
"""

import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
TF_MIN, TF_MAX = (2, 21), (2, 22)  # supported: 2.21.x
VERSION = {}
with open(os.path.join(HERE, "tf_sparse_split", "_version.py")) as f:
    exec(f.read(), VERSION)


def _fail(msg):
    sys.stderr.write("\ntf_sparse_split build error: " + msg + "\n\n")
    raise SystemExit(1)


def _tensorflow():
    try:
        import tensorflow as tf  # noqa: F401
    except ImportError:
        _fail(
            "TensorFlow is not installed in this environment. Install it first "
            "(`pip install 'tensorflow-cpu==2.21.*'` or `pip install "
            "'tensorflow==2.21.*'`), then `pip install --no-build-isolation .`."
        )
    ver = tuple(int(x) for x in tf.__version__.split(".")[:2])
    if not (TF_MIN <= ver < TF_MAX):
        _fail(
            f"TensorFlow {tf.__version__} is not supported; tf_sparse_split "
            f"supports {TF_MIN[0]}.{TF_MIN[1]}.x. Install `tensorflow-cpu==2.21.*`."
        )
    return tf


def _march_flags():
    march = os.environ.get("TFSS_MARCH", "native").strip()
    if march.lower() in ("", "none"):
        return [], "default (no -march)"
    if platform.machine().lower() not in ("x86_64", "amd64", "i686"):
        return ([f"-mcpu={march}"] if march != "native" else ["-mcpu=native"],
                f"-mcpu={march}")
    return [f"-march={march}"], f"-march={march}"


def _predefined_macros(flags):
    """The compiler's predefined macros under these flags ('' if unknown)."""
    import subprocess

    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run(
            [cxx, *flags, "-dM", "-E", "-x", "c++", os.devnull],
            capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def _isa_of(flags):
    """The SIMD instruction sets the compiler enables with these flags."""
    out = _predefined_macros(flags)
    if not out:
        return "unknown"
    found = [name for macro, name in (
        ("__AVX512F__", "AVX-512F"), ("__AVX2__", "AVX2"), ("__FMA__", "FMA"),
        ("__AVX__", "AVX"), ("__SSE4_2__", "SSE4.2"), ("__SSE2__", "SSE2"),
        ("__ARM_NEON", "NEON")) if f"#define {macro} " in out]
    return ", ".join(found) or "scalar"


def _find_nvcc():
    """Path of nvcc (NVCC, else PATH, else /usr/local/cuda/bin), or None."""
    env = os.environ.get("NVCC")
    if env and os.access(env, os.X_OK):
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def _cuda_mode(tf):
    """Decides TFSS_WITH_CUDA: returns (nvcc path or None, description)."""
    mode = os.environ.get("TFSS_WITH_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        _fail(f"TFSS_WITH_CUDA must be auto, 0 or 1, got {mode!r}.")
    if mode == "0":
        return None, "no (TFSS_WITH_CUDA=0)"
    nvcc = _find_nvcc()
    is_cuda_tf = bool(tf.sysconfig.get_build_info().get("is_cuda_build"))
    if mode == "1":
        if not is_cuda_tf:
            _fail("TFSS_WITH_CUDA=1 but this TensorFlow is not a CUDA build "
                  "(tf.sysconfig.get_build_info()['is_cuda_build'] is False, "
                  "e.g. tensorflow-cpu): GPU kernels could never be loaded "
                  "into it. Install `tensorflow[and-cuda]==2.21.*` or use "
                  "TFSS_WITH_CUDA=0/auto.")
        if nvcc is None:
            _fail("TFSS_WITH_CUDA=1 but nvcc was not found (looked at $NVCC, "
                  "PATH and /usr/local/cuda/bin/nvcc). Install the CUDA "
                  "toolkit or set NVCC, or use TFSS_WITH_CUDA=0/auto.")
    if not is_cuda_tf:
        return None, ("no (TFSS_WITH_CUDA=auto: this TensorFlow is CPU-only, "
                      "is_cuda_build=False)")
    if nvcc is None:
        return None, "no (TFSS_WITH_CUDA=auto: nvcc not found)"
    return nvcc, f"yes ({nvcc})"


def _cuda_home(nvcc):
    return os.environ.get("CUDA_HOME") or os.path.dirname(
        os.path.dirname(os.path.realpath(nvcc)))


def _cuda_sources():
    """Device code compiled by nvcc (the standalone harness under cc/tests is
    not part of the op library)."""
    return sorted(glob.glob("cc/core/**/*.cu.cc", recursive=True) +
                  glob.glob("cc/kernels/**/*.cu.cc", recursive=True))


def _nvcc_command(nvcc, src, obj, tf_flags):
    arch = os.environ.get("TFSS_CUDA_ARCH", "90").strip()
    # TF's flags minus those nvcc does not take as they are (--std=...).
    keep = [f for f in tf_flags if f.startswith(("-I", "-D"))]
    return [nvcc, "-x", "cu", "-std=c++17", "-O3",
            "-gencode", f"arch=compute_{arch},code=sm_{arch}",
            "-gencode", "arch=compute_80,code=compute_80",
            "-Xcompiler", "-fPIC", "-DGOOGLE_CUDA=1", "-I.", *keep,
            "-c", src, "-o", obj]


def _compile_cuda(nvcc, build_temp, tf_flags):
    """nvcc-compiles every CUDA source; returns the object paths."""
    objs = []
    for src in _cuda_sources():
        obj = os.path.join(build_temp, "cuda", src.replace("/", "_") + ".o")
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        cmd = _nvcc_command(nvcc, src, obj, tf_flags)
        print("tf_sparse_split: " + " ".join(cmd), flush=True)
        try:
            subprocess.run(cmd, check=True)
        except subprocess.CalledProcessError as e:
            _fail(f"nvcc failed on {src} (exit status {e.returncode}).")
        objs.append(obj)
    return objs


class BuildExt(build_ext):
    """Fills in TensorFlow's flags at build time (not at import of setup.py,
    so `setup.py --version` etc. work without TensorFlow)."""

    def run(self):
        # setuptools' run() clears self.inplace while building (and copies
        # the extensions afterwards); remember it for _build_info.py.
        self._tfss_inplace = bool(self.inplace)
        super().run()

    def build_extensions(self):
        tf = _tensorflow()
        march, march_desc = _march_flags()
        if "#define __AVX512FP16__ " in _predefined_macros(march):
            # TF 2.21's bundled Eigen does not compile with AVX512-FP16 under
            # GCC 12 (PacketMathFP16.h); fp16 arithmetic is not used here.
            march.append("-mno-avx512fp16")
            march_desc += " -mno-avx512fp16"
        isa = _isa_of(march)
        nvcc, cuda_desc = _cuda_mode(tf)
        print(f"tf_sparse_split: building against TensorFlow {tf.__version__} "
              f"with {march_desc} -> instruction sets: {isa}; CUDA kernels in "
              f"op library: {cuda_desc}", flush=True)
        common = ["-O3", "-std=c++17", "-fPIC", "-Wno-sign-compare", *march]
        for ext in self.extensions:
            if ext.name.endswith("_sparse_split_ops"):
                ext.extra_compile_args = [
                    *common, *tf.sysconfig.get_compile_flags(),
                    "-Wno-deprecated-declarations", "-Wno-unused-result"]
                ext.extra_link_args = [*tf.sysconfig.get_link_flags()]
                if nvcc is not None:
                    cuda_home = _cuda_home(nvcc)
                    ext.extra_objects = _compile_cuda(
                        nvcc, self.build_temp, tf.sysconfig.get_compile_flags())
                    ext.extra_compile_args += [
                        "-DGOOGLE_CUDA=1", f"-I{os.path.join(cuda_home, 'include')}"]
                    libdirs = [d for d in (os.path.join(cuda_home, "lib64"),
                                           os.path.join(cuda_home, "lib"))
                               if os.path.isdir(d)]
                    ext.extra_link_args += [
                        *(f"-L{d}" for d in libdirs),
                        *(f"-Wl,-rpath,{d}" for d in libdirs), "-lcudart"]
                    print("tf_sparse_split: op library gets -DGOOGLE_CUDA=1, "
                          f"{len(ext.extra_objects)} nvcc object(s), -lcudart "
                          f"from {', '.join(libdirs) or '(default path)'}",
                          flush=True)
            else:
                import pybind11

                ext.include_dirs.append(pybind11.get_include())
                ext.extra_compile_args = [*common, "-fvisibility=hidden"]
        # Extensions are built one after the other: both compile the
        # cc/core sources, with different flags, and setuptools names the
        # objects by source path, so a parallel (-j) build of the two would
        # race on the same object files (seen: a pybind11 module linked with
        # a half-written object that aborted on its first exception).
        self.parallel = None
        super().build_extensions()
        self._write_build_info(tf, march_desc, isa, nvcc)

    def _write_build_info(self, tf, march_desc, isa, nvcc):
        # After linking: the size and SHA-256 of the op library, which the
        # loader checks before handing the file to the dynamic loader.
        lib = self.get_ext_fullpath("tf_sparse_split._sparse_split_ops")
        with open(lib, "rb") as f:
            lib_sha256 = hashlib.sha256(f.read()).hexdigest()
        lib_size = os.path.getsize(lib)
        # Record what the library was built against; the loader checks it.
        # Written beside the built extensions (wheel) and, for in-place and
        # editable builds, into the source package as well.
        targets = {os.path.join(self.build_lib, "tf_sparse_split")}
        if (self.inplace or getattr(self, "_tfss_inplace", False)
                or getattr(self, "editable_mode", False)):
            targets.add(os.path.join(HERE, "tf_sparse_split"))
        for pkg_dir in targets:
            os.makedirs(pkg_dir, exist_ok=True)
            with open(os.path.join(pkg_dir, "_build_info.py"), "w") as f:
                f.write('"""Written by setup.py at build time."""\n')
                f.write(f"TF_VERSION = {tf.__version__!r}\n")
                f.write(f"MARCH = {march_desc!r}\n")
                f.write(f"ISA = {isa!r}\n")
                f.write(f"CUDA = {nvcc is not None!r}\n")
                f.write(f"LIB_SIZE = {lib_size!r}\n")
                f.write(f"LIB_SHA256 = {lib_sha256!r}\n")

    def build_extension(self, ext):
        # One temporary folder per extension, so their objects never mix.
        build_temp = self.build_temp
        self.build_temp = os.path.join(build_temp, ext.name.rsplit(".", 1)[-1])
        _parallel_compile(self.compiler, self.build_temp)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = build_temp


def _build_jobs():
    """TFSS_BUILD_JOBS (default: the CPUs this process may use)."""
    raw = os.environ.get("TFSS_BUILD_JOBS", "").strip()
    if raw:
        try:
            jobs = int(raw)
        except ValueError:
            _fail(f"TFSS_BUILD_JOBS must be a positive integer, got {raw!r}.")
        if jobs < 1:
            _fail(f"TFSS_BUILD_JOBS must be a positive integer, got {raw!r}.")
        return jobs
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _newest_header_mtime():
    """The newest modification time of the headers and included sources
    under cc/ (any of them may be included by any source)."""
    paths = (glob.glob(os.path.join(HERE, "cc", "**", "*.h"), recursive=True)
             + glob.glob(os.path.join(HERE, "cc", "**", "*.inc"), recursive=True))
    return max((os.path.getmtime(p) for p in paths), default=0.0)


def _parallel_compile(compiler, build_temp):
    """Replaces ``compiler.compile`` (distutils' CCompiler, the same steps)
    by one that compiles the sources of an extension on ``_build_jobs()``
    threads, and reuses an object left in ``build_temp`` by an earlier build
    when it is newer than its source and than every header under cc/ and
    was compiled with the same command-line arguments (a stamp file per
    folder); a fresh ``pip install`` builds in a fresh folder and compiles
    everything."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    if getattr(compiler, "_tfss_parallel", False):
        compiler._tfss_build_temp = build_temp
        return
    compiler._tfss_parallel = True
    compiler._tfss_build_temp = build_temp

    def compile(sources, output_dir=None, macros=None, include_dirs=None,
                debug=0, extra_preargs=None, extra_postargs=None,
                depends=None):
        macros, objects, extra, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        stamp = os.path.join(compiler._tfss_build_temp, "tfss_compile_args.json")
        args_now = json.dumps([list(cc_args), list(extra or []),
                               list(pp_opts or []), compiler.compiler_so])
        try:
            with open(stamp) as f:
                same_args = f.read() == args_now
        except OSError:
            same_args = False
        headers = _newest_header_mtime()

        def fresh(obj, src):
            if not same_args or not os.path.exists(obj):
                return False
            made = os.path.getmtime(obj)
            return made > os.path.getmtime(src) and made > headers

        todo = [o for o in objects if not fresh(o, build[o][0])]
        if len(todo) < len(objects):
            print(f"tf_sparse_split: {len(objects) - len(todo)} object(s) "
                  "up to date, not recompiled", flush=True)

        def one(obj):
            src, ext = build[obj]
            compiler._compile(obj, src, ext, cc_args, extra, pp_opts)

        jobs = min(_build_jobs(), max(1, len(todo)))
        with ThreadPoolExecutor(jobs) as pool:
            for _ in pool.map(one, todo):  # re-raises a compiler error
                pass
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            f.write(args_now)
        return objects

    compiler.compile = compile


def _sources(*patterns):
    out = []
    for p in patterns:
        out += sorted(glob.glob(os.path.join(p), recursive=True))
    return [s for s in out if not s.endswith(".cu.cc")]


CORE = _sources("cc/core/*.cc")
# Any source may include any of these: listed as both extensions' depends,
# so that `build_ext --inplace` after a change to a header alone rebuilds
# (setuptools skips an extension whose file is newer than its sources and
# depends; _parallel_compile then recompiles what the header touches).
HEADERS = _sources("cc/**/*.h", "cc/**/*.inc")
ops_ext = Extension(
    "tf_sparse_split._sparse_split_ops",
    sources=CORE + _sources("cc/ops/*.cc", "cc/kernels/*.cc", "cc/rewrite/*.cc"),
    depends=HEADERS,
    include_dirs=["."],
    language="c++",
)
kernels_ext = Extension(
    "tf_sparse_split._kernels",
    sources=CORE + _sources("cc/python/*.cc"),
    depends=HEADERS,
    include_dirs=["."],
    language="c++",
)

with open(os.path.join(HERE, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="tf_sparse_split",
    version=VERSION["__version__"],
    description=("TensorFlow ops, Keras layers and a callback that exploit "
                 "run-time sparsity in activations by splitting dense and "
                 "sparse work."),
    long_description=long_description,
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["tf_sparse_split", "tf_sparse_split.*"]),
    ext_modules=[ops_ext, kernels_ext],
    cmdclass={"build_ext": BuildExt},
    # TensorFlow itself is not listed: `tensorflow` and `tensorflow-cpu` are
    # different distributions providing the same module, and the op library
    # must be built against the one already installed (checked at build).
    install_requires=["numpy>=1.26", "keras>=3.10,<4", "scikit-learn>=1.3"],
    extras_require={"test": ["pytest>=8", "hypothesis>=6", "nbformat>=5"]},
    entry_points={"console_scripts": ["tf-sparse-split = tf_sparse_split.tools.cli:main"]},
    zip_safe=False,
)
