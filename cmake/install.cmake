# Installs libmoeblaze as a relocatable CMake package (moeblaze::moeblaze) and a pkg-config module.
#
#   find_package(moeblaze 0.1 CONFIG REQUIRED)   target_link_libraries(app PRIVATE moeblaze::moeblaze)
#   pkg-config --cflags --libs moeblaze
#
# Consumers need no CUDA: cudart is linked statically into libmoeblaze.so and hidden by the version
# script, so the package config has no find_dependency(CUDAToolkit). Threads is a PRIVATE link
# dependency of a shared library, so it does not appear in the exported interface either.
include(CMakePackageConfigHelpers)

set(MOEBLAZE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/moeblaze"
    CACHE STRING "moeblaze: where the CMake package files are installed (relative to the prefix)")
mark_as_advanced(MOEBLAZE_INSTALL_CMAKEDIR)

install(TARGETS moeblaze
  EXPORT moeblazeTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT development
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT development
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime
  PUBLIC_HEADER DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT development
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})

install(EXPORT moeblazeTargets
  NAMESPACE moeblaze::
  FILE moeblazeTargets.cmake
  DESTINATION ${MOEBLAZE_INSTALL_CMAKEDIR}
  COMPONENT development)

configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/moeblazeConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/moeblazeConfig.cmake"
  INSTALL_DESTINATION ${MOEBLAZE_INSTALL_CMAKEDIR})

# A request for 0.1 accepts any 0.x >= 0.1; the ABI itself is pinned by the SONAME
# (libmoeblaze.so.${MOEBLAZE_ABI_VERSION}), which a binary records when it links.
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/moeblazeConfigVersion.cmake"
  VERSION ${PROJECT_VERSION}
  COMPATIBILITY SameMajorVersion)

install(FILES
  "${PROJECT_BINARY_DIR}/moeblazeConfig.cmake"
  "${PROJECT_BINARY_DIR}/moeblazeConfigVersion.cmake"
  DESTINATION ${MOEBLAZE_INSTALL_CMAKEDIR}
  COMPONENT development)

# Build-tree package: -Dmoeblaze_DIR=<build dir> works without installing.
export(EXPORT moeblazeTargets
  NAMESPACE moeblaze::
  FILE "${PROJECT_BINARY_DIR}/moeblazeTargets.cmake")

# pkg-config. The prefix is derived from the .pc file's own location (${pcfiledir}), so the file is
# right wherever the tree is installed: `cmake --install build --prefix /opt/x` included, where the
# configure-time CMAKE_INSTALL_PREFIX would be wrong.
set(_moeblaze_pc_dir "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
if(IS_ABSOLUTE "${CMAKE_INSTALL_LIBDIR}" OR IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(MOEBLAZE_PC_PREFIX "${CMAKE_INSTALL_PREFIX}")
  set(MOEBLAZE_PC_LIBDIR "${CMAKE_INSTALL_FULL_LIBDIR}")
  set(MOEBLAZE_PC_INCLUDEDIR "${CMAKE_INSTALL_FULL_INCLUDEDIR}")
else()
  file(RELATIVE_PATH _moeblaze_pc_up "/prefix/${_moeblaze_pc_dir}" "/prefix")
  string(REGEX REPLACE "/$" "" _moeblaze_pc_up "${_moeblaze_pc_up}")
  set(MOEBLAZE_PC_PREFIX "\${pcfiledir}/${_moeblaze_pc_up}")
  set(MOEBLAZE_PC_LIBDIR "\${prefix}/${CMAKE_INSTALL_LIBDIR}")
  set(MOEBLAZE_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
configure_file("${CMAKE_CURRENT_LIST_DIR}/moeblaze.pc.in" "${PROJECT_BINARY_DIR}/moeblaze.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/moeblaze.pc"
  DESTINATION ${_moeblaze_pc_dir}
  COMPONENT development)
