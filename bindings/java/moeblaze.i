/* SWIG interface: the JNI module (Java package com.moeblaze.internal, native library moeblaze_jni).
 *
 * Conventions (bindings/README.md): every moeblaze_status_t is checked in C and a failure
 * throws com.moeblaze.MoeblazeException(status, message) with the library's message; pointers,
 * handles and streams are Java longs (0 = NULL); out-parameters are one-element arrays; versioned
 * structs are constructed already initialised by moeblaze_*_init(p, sizeof *p). No finalizers:
 * the idiomatic classes in com.moeblaze own everything and implement AutoCloseable.
 */
%module moeblaze

%{
#include <stdint.h>
#include <stdlib.h>
#include "moeblaze.h"

static void moeblaze_jni_throw(JNIEnv* jenv, moeblaze_status_t status) {
  /* Plain JNI C calls: SWIG's JCALLn macros only exist inside typemaps. */
  const char* message = moeblaze_last_error();
  jclass cls = (*jenv)->FindClass(jenv, "com/moeblaze/MoeblazeException");
  if (!cls) return; /* NoClassDefFoundError is pending */
  jmethodID ctor = (*jenv)->GetMethodID(jenv, cls, "<init>", "(ILjava/lang/String;)V");
  if (!ctor) return;
  jstring text = (*jenv)->NewStringUTF(jenv, (message && *message) ? message
                                                                  : moeblaze_status_name(status));
  if (!text) return;
  jthrowable error = (jthrowable)(*jenv)->NewObject(jenv, cls, ctor, (jint)status, text);
  if (error) (*jenv)->Throw(jenv, error);
}
%}

%include <stdint.i>
%javaconst(1);
/* "1u" is not a Java literal: fetch the unsigned flags through JNI. */
%javaconst(0) MOEBLAZE_BACKWARD_ACCUMULATE_WGRAD;
%javaconst(0) MOEBLAZE_BACKWARD_CONSUME_SAVED;
%javaconst(0) MOEBLAZE_FORWARD_WITH_SAVED;
%typemap(javafinalize) SWIGTYPE ""

/* NativeLoader: -Dmoeblaze.jni.library, else java.library.path, else the natives in the jar. */
%pragma(java) jniclasscode=%{
  static {
    NativeLoader.load();
  }
%}

/* ---- status -> exception --------------------------------------------------------------------- */
%typemap(jni) moeblaze_status_t "void"
%typemap(jtype) moeblaze_status_t "void"
%typemap(jstype) moeblaze_status_t "void"
%typemap(javaout) moeblaze_status_t { $jnicall; }
/* ... but a status passed in (moeblaze_status_name/_string) is a plain int. */
%typemap(jni) moeblaze_status_t status "jint"
%typemap(jtype) moeblaze_status_t status "int"
%typemap(jstype) moeblaze_status_t status "int"
%typemap(javain) moeblaze_status_t status "$javainput"
%typemap(in) moeblaze_status_t status { $1 = (moeblaze_status_t)$input; }
%typemap(out) moeblaze_status_t {
  if ($1 != MOEBLAZE_OK) {
    moeblaze_jni_throw(jenv, $1);
    return $null;
  }
}

/* ---- pointers, handles and streams as long --------------------------------------------------- */
%define MOEBLAZE_POINTER_AS_LONG(TYPE)
%typemap(jni) TYPE "jlong"
%typemap(jtype) TYPE "long"
%typemap(jstype) TYPE "long"
%typemap(javain) TYPE "$javainput"
%typemap(javaout) TYPE { return $jnicall; }
%typemap(in) TYPE { $1 = ($1_ltype)(intptr_t)$input; }
%typemap(out) TYPE { $result = (jlong)(intptr_t)$1; }
%enddef
MOEBLAZE_POINTER_AS_LONG(void*)
MOEBLAZE_POINTER_AS_LONG(const void*)
MOEBLAZE_POINTER_AS_LONG(int32_t*)
MOEBLAZE_POINTER_AS_LONG(const int32_t*)
MOEBLAZE_POINTER_AS_LONG(moeblaze_context_t)
MOEBLAZE_POINTER_AS_LONG(moeblaze_layer_t)

/* ---- out-parameters as one-element arrays ---------------------------------------------------- */
%define MOEBLAZE_OUT_ARRAY(CTYPE, NAME, JNITYPE, JAVATYPE, JARRAY, SETREGION, JELEM)
%typemap(jni) CTYPE* NAME #JARRAY
%typemap(jtype) CTYPE* NAME #JAVATYPE "[]"
%typemap(jstype) CTYPE* NAME #JAVATYPE "[]"
%typemap(javain) CTYPE* NAME "$javainput"
%typemap(in) CTYPE* NAME (CTYPE temp = 0) {
  if (!$input || JCALL1(GetArrayLength, jenv, $input) < 1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException,
                            "$1_name: need an array of length >= 1");
    return $null;
  }
  $1 = &temp;
}
%typemap(argout) CTYPE* NAME {
  JELEM value = (JELEM)temp$argnum;
  JCALL4(SETREGION, jenv, $input, 0, 1, &value);
}
%enddef
MOEBLAZE_OUT_ARRAY(moeblaze_context_t, out, jlongArray, long, jlongArray, SetLongArrayRegion, jlong)
MOEBLAZE_OUT_ARRAY(moeblaze_layer_t, out, jlongArray, long, jlongArray, SetLongArrayRegion, jlong)
MOEBLAZE_OUT_ARRAY(size_t, bytes, jlongArray, long, jlongArray, SetLongArrayRegion, jlong)
MOEBLAZE_OUT_ARRAY(int32_t, backend, jintArray, int, jintArray, SetIntArrayRegion, jint)
MOEBLAZE_OUT_ARRAY(int32_t, device, jintArray, int, jintArray, SetIntArrayRegion, jint)

/* The handle out-parameters hold pointers: convert through intptr_t. */
%typemap(argout) moeblaze_context_t* out {
  jlong value = (jlong)(intptr_t)temp$argnum;
  JCALL4(SetLongArrayRegion, jenv, $input, 0, 1, &value);
}
%typemap(argout) moeblaze_layer_t* out {
  jlong value = (jlong)(intptr_t)temp$argnum;
  JCALL4(SetLongArrayRegion, jenv, $input, 0, 1, &value);
}

/* ---- direct ByteBuffers: their native address, for host data --------------------------------- */
%{
typedef void* moeblaze_java_direct_buffer;
%}
typedef void* moeblaze_java_direct_buffer;
%typemap(jni) moeblaze_java_direct_buffer "jobject"
%typemap(jtype) moeblaze_java_direct_buffer "java.nio.Buffer"
%typemap(jstype) moeblaze_java_direct_buffer "java.nio.Buffer"
%typemap(javain) moeblaze_java_direct_buffer "$javainput"
%typemap(in) moeblaze_java_direct_buffer {
  $1 = $input ? JCALL1(GetDirectBufferAddress, jenv, $input) : NULL;
  if ($input && !$1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, "not a direct buffer");
    return $null;
  }
}
%inline %{
/* The native address of a direct java.nio buffer (0 for null). */
int64_t moeblaze_java_buffer_address(moeblaze_java_direct_buffer buffer) {
  return (int64_t)(intptr_t)buffer;
}
%}

/* ---- struct proxies after delete() -------------------------------------------------------------
 * delete() frees the C struct and zeroes the proxy's pointer. SWIG's field setters then skip the
 * write silently and its getters dereference NULL (a JVM crash): every accessor refuses a deleted
 * struct instead, as the com.moeblaze classes refuse a closed handle. */
%typemap(check) SWIGTYPE* self {
  if (!$1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalStateException,
                            "$1_basetype: used after delete()");
    return $null;
  }
}

/* ---- versioned structs ----------------------------------------------------------------------- */
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

%ignore moeblaze_copy_last_error; /* moeblaze_last_error() returns the same text as a String */
%ignore moeblaze_context_s;
%ignore moeblaze_layer_s;

%include "moeblaze.h"
