# ctest -R examples_c_bitwise: trains twice with different settings that must not change the result
# (checkpoint policy, thread count) and requires bitwise equal final weights.
#   cmake -DTRAIN=<train_moe> -DCOMMON="--steps;60" -DA="--checkpoint;save_all" -DB="..." -P this
foreach(_run A B)
  execute_process(COMMAND "${TRAIN}" ${COMMON} ${${_run}} OUTPUT_VARIABLE _out ERROR_VARIABLE _err
                  RESULT_VARIABLE _rc)
  string(REGEX MATCH "final weights checksum: [0-9a-f]+" _sum "${_out}")
  string(REGEX MATCH "held-out loss: [^\n]*" _loss "${_out}")
  message(STATUS "${_run}: ${${_run}} -> ${_loss}; ${_sum}")
  if(NOT _sum)
    message(FATAL_ERROR "run ${_run} printed no checksum (exit ${_rc}):\n${_out}\n${_err}")
  endif()
  set(_sum_${_run} "${_sum}")
endforeach()
if(NOT _sum_A STREQUAL _sum_B)
  message(FATAL_ERROR "the two runs differ: ${_sum_A} vs ${_sum_B}")
endif()
message(STATUS "bitwise identical")
