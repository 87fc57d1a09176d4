# Runs EXE with ARGS (a ;-list) and passes when it exits with CODE and its output (stdout and
# stderr) contains MESSAGE.
execute_process(COMMAND ${EXE} ${ARGS} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc STREQUAL "${CODE}")
  message(FATAL_ERROR "expected exit status ${CODE}, got '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
string(FIND "${out}${err}" "${MESSAGE}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "output lacks '${MESSAGE}':\n${out}${err}")
endif()
message(STATUS "exit ${rc}: ${err}")
