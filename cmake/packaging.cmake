# SPDX-License-Identifier: Apache-2.0
# The Debian package: `cpack -G DEB` in a build folder writes
# ferry_<version>_amd64.deb with everything `cmake --install` puts under /usr:
# libferry.so, the plugins (lib/ferry/plugins), the headers, the CMake package
# and pkg-config file, `ferry` and `ferry-bench`, the Python package, and the
# example plugin's sources (share/ferry/plugin-template) to copy.
#
# Depends lists what libferry.so and the binaries need. The plugins' own
# libraries (libfabric for ofi, libibverbs for rdma) are Recommends: a plugin
# whose library is missing is listed by `ferry info` with the reason and never
# stops the rest from loading.
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME ferry)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_VENDOR "ferry developers")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
  "one-sided READ/WRITE between registered memory of two processes, pluggable backends")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # ferry_<version>_<arch>.deb
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "ferry developers <ferry@localhost>")
set(CPACK_DEBIAN_PACKAGE_SECTION libs)
# libcurl4: the etcd metadata client; libcpp-httplib0.11: the /metrics endpoint.
set(CPACK_DEBIAN_PACKAGE_DEPENDS
  "libc6 (>= 2.36), libstdc++6 (>= 12), libyaml-cpp0.7, libssl3, libcurl4, libcpp-httplib0.11")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "libfabric1, libibverbs1, ibverbs-providers")
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "python3 (>= 3.11), python3-numpy")
set(CPACK_STRIP_FILES OFF)
include(CPack)
