# Writes the revision that moeblaze_build_info() reports into OUTPUT, as
#   #define MOEBLAZE_GIT_REVISION "<12 hex digits>[-dirty]"
# Run by the moeblaze_revision target at every build (cmake -P), so the revision follows each
# commit without a new configure; the file is rewritten only when it changes, so an unchanged
# revision recompiles nothing. $MOEBLAZE_COMMIT wins: a copy of the tree (a GPU machine's) can
# carry a .git whose HEAD is not the commit of its files. Inputs: SOURCE_DIR, OUTPUT.
if(DEFINED ENV{MOEBLAZE_COMMIT} AND NOT "$ENV{MOEBLAZE_COMMIT}" STREQUAL "")
  set(revision "$ENV{MOEBLAZE_COMMIT}")
else()
  execute_process(COMMAND git rev-parse --short=12 HEAD WORKING_DIRECTORY "${SOURCE_DIR}"
    OUTPUT_VARIABLE revision OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  # Tracked files that differ from HEAD (as bench/run_bench.py marks its commit): "-dirty".
  if(revision)
    execute_process(COMMAND git status --porcelain --untracked-files=no
      WORKING_DIRECTORY "${SOURCE_DIR}" OUTPUT_VARIABLE changes
      OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(changes)
      string(APPEND revision "-dirty")
    endif()
  endif()
endif()
if(NOT revision)
  set(revision "unknown")
endif()
set(content "#define MOEBLAZE_GIT_REVISION \"${revision}\"\n")
if(EXISTS "${OUTPUT}")
  file(READ "${OUTPUT}" previous)
endif()
if(NOT "${previous}" STREQUAL "${content}")
  file(WRITE "${OUTPUT}" "${content}")
endif()
