"""Everything the jzyfa Bazel build needs from outside its own tree, all local.

Call `jzyfa_dependencies()` from a WORKSPACE (jzyfa's own, or one that depends
on jzyfa as `@jzyfa`). It defines:

  @jzyfa_python          the Python interpreter (PYTHON_BIN_PATH, else `python3`
                         on PATH), its headers, nanobind built from the sources
                         its pip package ships, the XLA FFI headers of
                         `jax.ffi.include_dir()`, the extension suffix and the
                         wheel name;
  @jzyfa_cuda            the local CUDA toolkit: nvcc, headers, static cudart;
  @rules_cc, @rules_java, @remote_coverage_tools
                         small local stand-ins for the three repositories
                         Bazel 4.2.3 would otherwise download (docs/bazel.md).

Nothing here downloads anything.
"""

load("//bazel:local_cuda.bzl", "jzyfa_cuda_configure")
load("//bazel:local_python.bzl", "jzyfa_python_configure")

def _stub_repository_impl(rctx):
    # The stand-ins live in bazel/stubs/<name>/ of the jzyfa tree; find that
    # tree through a label so this works from any workspace.
    bazel_dir = rctx.path(rctx.attr._anchor).dirname
    src = bazel_dir.get_child("stubs").get_child(rctx.attr.stub)
    if not src.exists:
        fail("jzyfa: missing stub directory %s" % src)
    for entry in src.readdir():
        rctx.symlink(entry, entry.basename)

_stub_repository = repository_rule(
    implementation = _stub_repository_impl,
    attrs = {
        "stub": attr.string(mandatory = True),
        "_anchor": attr.label(default = Label("//bazel:BUILD.bazel")),
    },
    doc = "A local repository made of the files under bazel/stubs/<stub>/.",
    local = True,
)

# The repositories Bazel 4.2.3 fetches over the network for a C++ build with a
# test target, and the stand-in that replaces each.
OFFLINE_STUBS = ["rules_cc", "rules_java", "remote_coverage_tools"]

def jzyfa_dependencies(stubs = True):
    """Defines the local repositories the jzyfa build needs.

    Args:
      stubs: also define the offline stand-ins for @rules_cc, @rules_java and
        @remote_coverage_tools (each only where the workspace has not already
        defined that name, so a workspace with the real ones keeps them).
    """
    if stubs:
        for name in OFFLINE_STUBS:
            if not native.existing_rule(name):
                _stub_repository(name = name, stub = name)
    if not native.existing_rule("jzyfa_python"):
        jzyfa_python_configure(name = "jzyfa_python")
    if not native.existing_rule("jzyfa_cuda"):
        jzyfa_cuda_configure(name = "jzyfa_cuda")
