"""Local stand-in for @rules_java//java:defs.bzl.

jzyfa builds no Java. Bazel 4.2.3 still loads this file while it parses
@bazel_tools//tools/jdk (registered as a toolchain package in every
workspace), so it must exist; the names forward to the native rules.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
