# API reference: Doxygen over include/moeblaze.h, warnings as errors.
#   cmake --build <build> --target moeblaze_docs      ->  <build>/docs/api/html/index.html
# Included by the top-level CMakeLists.txt when MOEBLAZE_BUILD_DOCS=ON. Debian: apt-get install doxygen.
find_package(Doxygen QUIET)
if(NOT DOXYGEN_FOUND)
  message(STATUS "moeblaze: doxygen not found; the API reference (moeblaze_docs) is not built")
  return()
endif()

set(MOEBLAZE_DOCS_OUTPUT_DIR "${PROJECT_BINARY_DIR}/docs/api")
set(MOEBLAZE_DOCS_XML NO)
configure_file("${CMAKE_CURRENT_LIST_DIR}/Doxyfile.in" "${PROJECT_BINARY_DIR}/Doxyfile" @ONLY)

# A stamp makes the target rerun only when the header or the configuration changed.
set(_docs_stamp "${MOEBLAZE_DOCS_OUTPUT_DIR}/html/index.html")
add_custom_command(
  OUTPUT "${_docs_stamp}"
  COMMAND ${CMAKE_COMMAND} -E make_directory "${MOEBLAZE_DOCS_OUTPUT_DIR}"
  COMMAND ${CMAKE_COMMAND} -E remove -f "${MOEBLAZE_DOCS_OUTPUT_DIR}/doxygen-warnings.log"
  COMMAND Doxygen::doxygen "${PROJECT_BINARY_DIR}/Doxyfile"
  DEPENDS "${PROJECT_SOURCE_DIR}/include/moeblaze.h" "${PROJECT_BINARY_DIR}/Doxyfile"
  WORKING_DIRECTORY "${PROJECT_BINARY_DIR}"
  COMMENT "Doxygen: API reference from include/moeblaze.h (warnings are errors)"
  VERBATIM)
add_custom_target(moeblaze_docs DEPENDS "${_docs_stamp}")

install(DIRECTORY "${MOEBLAZE_DOCS_OUTPUT_DIR}/html/"
  DESTINATION "${CMAKE_INSTALL_DOCDIR}/api"
  COMPONENT docs OPTIONAL)

if(MOEBLAZE_BUILD_TESTS)
  # Runs doxygen again into its own folder so that the test fails on warnings even when the build
  # step was skipped, and shows them in the test output.
  add_test(NAME api_docs
    COMMAND ${CMAKE_COMMAND} -DDOXYGEN=$<TARGET_FILE:Doxygen::doxygen>
            -DDOXYFILE=${PROJECT_BINARY_DIR}/Doxyfile -DOUT=${PROJECT_BINARY_DIR}/docs/api-test
            -P ${CMAKE_CURRENT_LIST_DIR}/docs_test.cmake)
  set_tests_properties(api_docs PROPERTIES LABELS api TIMEOUT 300)
endif()
