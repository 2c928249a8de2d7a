"""Compiling CUDA sources with the local nvcc (@jzyfa_cuda//:nvcc).

Bazel 4.2.3 has no CUDA rules of its own. `cuda_library` runs nvcc once per
`.cu` file in a genrule, producing position-independent objects (`.pic.o`),
and wraps them in a cc_library that C++ targets can depend on. The host
compiler nvcc uses is the C++ toolchain's ($(CC)).
"""

def _exec_root_dir(package_relative_dir):
    """The path of a directory of this package, relative to the exec root."""
    parts = []
    repo = native.repository_name()
    if repo and repo != "@":
        parts.append("external/" + repo.lstrip("@"))
    if native.package_name():
        parts.append(native.package_name())
    if package_relative_dir and package_relative_dir != ".":
        parts.append(package_relative_dir)
    return "/".join(parts) or "."

def cuda_library(
        name,
        srcs,
        hdrs = [],
        includes = [],
        nvcc_flags = [],
        deps = [],
        visibility = None):
    """Compiles `srcs` (.cu) with nvcc into a cc_library named `name`.

    Args:
      name: the cc_library.
      srcs: .cu files, one nvcc action each.
      hdrs: every header (source or generated) the .cu files may include.
      includes: package-relative directories searched for includes, both in
        the source tree and in the output tree (for generated headers).
      nvcc_flags: flags for nvcc (architecture, optimization, -std, ...).
      deps: cc_library dependencies of the objects (e.g. the CUDA runtime).
      visibility: of the cc_library.
    """
    include_flags = []
    for d in includes:
        path = _exec_root_dir(d)
        include_flags += ["-I" + path, "-I$(GENDIR)/" + path]

    objects = []
    for src in srcs:
        stem = src.split("/")[-1].rsplit(".", 1)[0]
        out = "_objs/%s/%s.pic.o" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem),
            srcs = [src] + hdrs,
            outs = [out],
            tools = ["@jzyfa_cuda//:nvcc"],
            toolchains = ["@bazel_tools//tools/cpp:current_cc_toolchain"],
            cmd = " ".join([
                "$(location @jzyfa_cuda//:nvcc)",
                "-ccbin $(CC)",
                "-Xcompiler=-fPIC",
            ] + nvcc_flags + include_flags + [
                "-x cu -c $(location %s)" % src,
                "-o $@",
            ]),
            message = "Compiling %s with nvcc" % src,
            visibility = ["//visibility:private"],
        )
        objects.append(out)

    native.cc_library(
        name = name,
        srcs = objects,
        deps = deps,
        linkstatic = True,
        visibility = visibility,
    )
