/* The loaded library reports the version of the header it was built from, and the ABI version that
 * is its SONAME suffix. Links against libmoeblaze; prints what it compares. */
#include <stdio.h>
#include <string.h>

#include "moeblaze.h"

int main(void) {
  int failures = 0;
  const int32_t version = moeblaze_get_version();
  const int32_t abi = moeblaze_get_abi_version();
  const char* info = moeblaze_get_build_info();
  printf("header  %d.%d.%d (MOEBLAZE_VERSION %d, ABI %d)\n", MOEBLAZE_VERSION_MAJOR,
         MOEBLAZE_VERSION_MINOR, MOEBLAZE_VERSION_PATCH, MOEBLAZE_VERSION, MOEBLAZE_ABI_VERSION);
  printf("library MOEBLAZE_VERSION %d, ABI %d\n", (int)version, (int)abi);
  printf("build   %s\n", info ? info : "(NULL)");
  if (version != MOEBLAZE_VERSION) {
    printf("FAIL: moeblaze_get_version() = %d, header says %d\n", (int)version, MOEBLAZE_VERSION);
    failures++;
  }
  if (abi != MOEBLAZE_ABI_VERSION) {
    printf("FAIL: moeblaze_get_abi_version() = %d, header says %d\n", (int)abi,
           MOEBLAZE_ABI_VERSION);
    failures++;
  }
  if (info == NULL || strlen(info) == 0) {
    printf("FAIL: moeblaze_get_build_info() is empty\n");
    failures++;
  }
  if (MOEBLAZE_VERSION !=
      MOEBLAZE_VERSION_MAJOR * 10000 + MOEBLAZE_VERSION_MINOR * 100 + MOEBLAZE_VERSION_PATCH) {
    printf("FAIL: MOEBLAZE_VERSION disagrees with its parts\n");
    failures++;
  }
  /* Status names are part of the ABI: spot-check that the table matches the frozen values. */
  if (strcmp(moeblaze_status_name(MOEBLAZE_OK), "MOEBLAZE_OK") != 0 ||
      strcmp(moeblaze_status_name(MOEBLAZE_ERR_INTERNAL), "MOEBLAZE_ERR_INTERNAL") != 0) {
    printf("FAIL: moeblaze_status_name() does not match the enumerator names\n");
    failures++;
  }
  printf("%s\n", failures ? "version check FAILED" : "version check passed");
  return failures ? 1 : 0;
}
