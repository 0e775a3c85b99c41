/* SWIG interface: the 1:1 low-level Python module `moeblaze_swig` (extension `_moeblaze_swig`).
 *
 * Conventions (bindings/README.md):
 * - every moeblaze_status_t is checked: a failure raises ValueError (INVALID_ARGUMENT),
 *   NotImplementedError (NOT_SUPPORTED), MemoryError (OUT_OF_MEMORY) or RuntimeError (others)
 *   carrying the library's message and a `status` attribute; success returns None or the outputs;
 * - void* (tensors, buffers, streams) and int32_t* data pointers are Python ints (None = NULL);
 * - handles created through out-parameters are returned and owned by Python: the proxy's
 *   destructor calls moeblaze_*_destroy (the destroy functions themselves are not wrapped);
 * - versioned structs are constructed already initialised by moeblaze_*_init(p, sizeof *p).
 *
 * The idiomatic Python API is the ctypes package `moeblaze` (one module for every CPython; SWIG 4.1
 * modules are tied to one Python minor version).
 */
%module(docstring="Low-level 1:1 SWIG wrapper of libmoeblaze (include/moeblaze.h).") moeblaze_swig

%{
#include <stdlib.h>
#include "moeblaze.h"

/* Raises the Python exception for a failed status, with the thread's last error message. */
static void moeblaze_swig_raise(moeblaze_status_t status) {
  PyObject* type = PyExc_RuntimeError;
  if (status == MOEBLAZE_ERR_INVALID_ARGUMENT) type = PyExc_ValueError;
  else if (status == MOEBLAZE_ERR_NOT_SUPPORTED) type = PyExc_NotImplementedError;
  else if (status == MOEBLAZE_ERR_OUT_OF_MEMORY) type = PyExc_MemoryError;
  const char* message = moeblaze_last_error();
  PyObject* error = PyObject_CallFunction(type, "s", (message && *message)
                                                         ? message : moeblaze_status_name(status));
  if (!error) return; /* the constructor raised: keep that exception */
  PyObject* code = PyLong_FromLong((long)status);
  if (code) {
    PyObject_SetAttrString(error, "status", code);
    Py_DECREF(code);
  }
  PyErr_SetObject(type, error);
  Py_DECREF(error);
}

static int moeblaze_swig_as_pointer(PyObject* input, void** out) {
  if (input == Py_None) {
    *out = NULL;
    return 0;
  }
  *out = PyLong_AsVoidPtr(input);
  return PyErr_Occurred() ? -1 : 0;
}
%}

%include <stdint.i>
%include <typemaps.i>
%include <cstring.i>

/* ---- status -> exception --------------------------------------------------------------------- */
%typemap(out) moeblaze_status_t {
  if ($1 != MOEBLAZE_OK) {
    moeblaze_swig_raise($1);
    SWIG_fail;
  }
  $result = SWIG_Py_Void();
}

/* ---- pointers as integers -------------------------------------------------------------------- */
%define MOEBLAZE_POINTER_AS_INT(TYPE)
%typemap(in) TYPE {
  void* pointer_value;
  if (moeblaze_swig_as_pointer($input, &pointer_value) != 0) SWIG_fail;
  $1 = ($1_ltype)pointer_value;
}
%typemap(out) TYPE {
  $result = $1 ? PyLong_FromVoidPtr((void*)$1) : SWIG_Py_Void();
}
%typemap(typecheck, precedence=SWIG_TYPECHECK_POINTER) TYPE {
  $1 = ($input == Py_None || PyLong_Check($input)) ? 1 : 0;
}
%enddef
MOEBLAZE_POINTER_AS_INT(void*)
MOEBLAZE_POINTER_AS_INT(const void*)
MOEBLAZE_POINTER_AS_INT(int32_t*)
MOEBLAZE_POINTER_AS_INT(const int32_t*)

/* Genuine out-parameters (not tensors). */
%apply int32_t* OUTPUT { int32_t* backend, int32_t* device };
%apply size_t* OUTPUT { size_t* bytes };
%cstring_output_maxsize(char* buffer, size_t buffer_size);

/* ---- handles: created through out-parameters, destroyed by the Python proxy ------------------ */
%define MOEBLAZE_OWNED_HANDLE(STRUCT, HANDLE, DESTROY)
%nodefaultctor STRUCT;
%ignore DESTROY;
struct STRUCT {};
%extend STRUCT {
  ~STRUCT() { DESTROY($self); }
}
%typemap(in, numinputs=0) HANDLE* out (HANDLE created = NULL) { $1 = &created; }
%typemap(argout) HANDLE* out {
  $result = SWIG_Python_AppendOutput($result,
      SWIG_NewPointerObj(SWIG_as_voidptr(*$1), $descriptor(struct STRUCT*), SWIG_POINTER_OWN));
}
%enddef
MOEBLAZE_OWNED_HANDLE(moeblaze_context_s, moeblaze_context_t, moeblaze_context_destroy)
MOEBLAZE_OWNED_HANDLE(moeblaze_layer_s, moeblaze_layer_t, moeblaze_layer_destroy)

/* ---- versioned structs: constructed initialised, freed by the proxy -------------------------- */
%define MOEBLAZE_VERSIONED_STRUCT(TAG, INIT)
%immutable TAG::struct_size;
%extend TAG {
  TAG() {
    struct TAG* p = (struct TAG*)calloc(1, sizeof(struct TAG));
    if (p && INIT(p, sizeof *p) != MOEBLAZE_OK) {
      free(p);
      p = NULL;
    }
    return p;
  }
  ~TAG() { free($self); }
}
%enddef
MOEBLAZE_VERSIONED_STRUCT(moeblaze_layer_config, moeblaze_layer_config_init)
MOEBLAZE_VERSIONED_STRUCT(moeblaze_forward_args, moeblaze_forward_args_init)
MOEBLAZE_VERSIONED_STRUCT(moeblaze_backward_args, moeblaze_backward_args_init)

%include "moeblaze.h"
