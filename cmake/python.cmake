# The Python interpreter of every Python test (bindings, examples, benchmark smoke tests):
# MOEBLAZE_PYTHON. scripts/setup.sh passes its virtual environment's interpreter (.venv/bin/python,
# with bindings/python/requirements-test.txt installed) as MOEBLAZE_PYTHON and Python3_EXECUTABLE.
# Configured by hand, the first of Python3_EXECUTABLE, /usr/bin/python3 and the python3 on PATH that
# has numpy and pytest is taken: probed, not guessed.
#
# Sets MOEBLAZE_PYTHON (cache; empty when none qualifies) and MOEBLAZE_PYTHON_HAS_TORCH.
include_guard(GLOBAL)

set(MOEBLAZE_PYTHON "" CACHE FILEPATH
    "moeblaze: Python interpreter for the Python tests (needs numpy and pytest; torch optional)")
# The set-up's virtual environment, when scripts/setup.sh configured the build (the `scripts`
# test checks that MOEBLAZE_PYTHON is its interpreter).
set(MOEBLAZE_SETUP_VENV "" CACHE PATH "moeblaze: the virtual environment scripts/setup.sh made")

if(NOT MOEBLAZE_PYTHON)
  set(_moeblaze_py_candidates "")
  if(Python3_EXECUTABLE)
    list(APPEND _moeblaze_py_candidates "${Python3_EXECUTABLE}")
  endif()
  find_program(_moeblaze_path_python3 NAMES python3 NO_CACHE)
  list(APPEND _moeblaze_py_candidates /usr/bin/python3 ${_moeblaze_path_python3})
  foreach(_candidate IN LISTS _moeblaze_py_candidates)
    if(EXISTS "${_candidate}")
      execute_process(COMMAND "${_candidate}" -c "import numpy, pytest"
        RESULT_VARIABLE _moeblaze_py_rc OUTPUT_QUIET ERROR_QUIET)
      if(_moeblaze_py_rc EQUAL 0)
        set_property(CACHE MOEBLAZE_PYTHON PROPERTY VALUE "${_candidate}")
        break()
      endif()
    endif()
  endforeach()
endif()

set(MOEBLAZE_PYTHON_HAS_TORCH OFF)
if(MOEBLAZE_PYTHON)
  execute_process(COMMAND "${MOEBLAZE_PYTHON}" -c "import torch; print(torch.__version__)"
    RESULT_VARIABLE _moeblaze_torch_rc OUTPUT_VARIABLE MOEBLAZE_PYTHON_TORCH_VERSION
    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_moeblaze_torch_rc EQUAL 0)
    set(MOEBLAZE_PYTHON_HAS_TORCH ON)
  endif()
  message(STATUS "moeblaze: Python tests use ${MOEBLAZE_PYTHON} (torch: "
                 "${MOEBLAZE_PYTHON_HAS_TORCH} ${MOEBLAZE_PYTHON_TORCH_VERSION})")
else()
  message(STATUS "moeblaze: no Python with numpy and pytest: the Python tests are not registered "
                 "(scripts/setup.sh makes one in .venv; or set MOEBLAZE_PYTHON)")
endif()
