# cmake -DJNI_LIBRARY=<file> -DCORE_LIBRARY=<file> -DCORE_SONAME=<name> -DSTAGE=<dir>
#       -DPLATFORM=<os-arch> -P stage_natives.cmake
# Lays out <STAGE>/native/<PLATFORM>/ for the jar: the core library under its SONAME (what the JNI
# library's DT_NEEDED asks for), libmoeblaze_jni.so with its build-tree RUNPATH replaced by $ORIGIN
# (as `cmake --install` would do), and LIBRARIES, the load order NativeLoader follows.
foreach(_var JNI_LIBRARY CORE_LIBRARY CORE_SONAME STAGE PLATFORM)
  if(NOT ${_var})
    message(FATAL_ERROR "stage_natives.cmake: ${_var} is not set")
  endif()
endforeach()
set(_dir "${STAGE}/native/${PLATFORM}")
file(REMOVE_RECURSE "${STAGE}")
file(MAKE_DIRECTORY "${_dir}")
file(COPY_FILE "${CORE_LIBRARY}" "${_dir}/${CORE_SONAME}")
get_filename_component(_jni_name "${JNI_LIBRARY}" NAME)
file(COPY_FILE "${JNI_LIBRARY}" "${_dir}/${_jni_name}")
# The build-tree RUNPATH would find the core in the build tree and hide a broken jar.
file(RPATH_SET FILE "${_dir}/${_jni_name}" NEW_RPATH "$ORIGIN")
file(WRITE "${_dir}/LIBRARIES" "${CORE_SONAME}\n${_jni_name}\n")
