"""Offline stand-in for rules_cc's cc/defs.bzl: the native C++ rules under their rules_cc names.

Bazel 4.2.3 (Debian's bazel-bootstrap) generates @local_config_cc with
load("@rules_cc//cc:defs.bzl", ...); rules_cc 0.0.1 of that era only wrapped the native rules,
so forwarding to them is what the real repository would do.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def fdo_prefetch_hints(**attrs):
    native.fdo_prefetch_hints(**attrs)

def fdo_profile(**attrs):
    native.fdo_profile(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)

def objc_import(**attrs):
    native.objc_import(**attrs)
