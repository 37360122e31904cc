// Anchor for the precompiled libtorch header (see CMakeLists.txt).
