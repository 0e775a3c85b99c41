# cmake -DOUT=<file> -DDIRS=<dir|dir> -P list_sources.cmake: writes every .java file under DIRS,
# one per line, for `javac @<file>` (the SWIG-generated names are only known after SWIG ran).
set(_sources "")
string(REPLACE "|" ";" DIRS "${DIRS}")
foreach(_dir IN LISTS DIRS)
  file(GLOB_RECURSE _found "${_dir}/*.java")
  list(APPEND _sources ${_found})
endforeach()
list(SORT _sources)
list(JOIN _sources "\n" _text)
file(WRITE "${OUT}" "${_text}\n")
