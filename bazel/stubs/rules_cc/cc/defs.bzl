"""Local stand-in for @rules_cc//cc:defs.bzl.

Bazel 4.2.3 implements every C++ rule natively; the real rules_cc at this
point in time is only a set of thin macros over `native.*`. This file offers
the same names so that `load("@rules_cc//cc:defs.bzl", ...)` in Bazel's own
tools and in the generated @local_config_cc resolves without a download.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
