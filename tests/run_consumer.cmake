# Installs the build tree into a fresh prefix, then configures, builds and runs the consumer project
# (tests/consumer) against that prefix only: proves that `cmake --install` + find_package(flashattn)
# + flashattn::flashattn is all a downstream project needs.
#
#   cmake -DBUILD_DIR=... -DWORK_DIR=... -DSOURCE_DIR=... -DGENERATOR=... [-DMAKE_PROGRAM=...]
#         -DCXX=... [-DCONFIG=Release] [-DCXX_FLAGS=...] [-DLINKER_FLAGS=...] -P run_consumer.cmake
foreach(var BUILD_DIR WORK_DIR SOURCE_DIR GENERATOR CXX)
  if(NOT ${var})
    message(FATAL_ERROR "run_consumer.cmake: ${var} is not set")
  endif()
endforeach()
if(NOT CONFIG)
  set(CONFIG Release)
endif()

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  message(STATUS "${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")

run("cmake --install" "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}" --config "${CONFIG}")

set(configure_args -S "${SOURCE_DIR}" -B "${build}" -G "${GENERATOR}"
    "-DCMAKE_PREFIX_PATH=${prefix}" "-DCMAKE_CXX_COMPILER=${CXX}" "-DCMAKE_BUILD_TYPE=${CONFIG}"
    "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}"
    # Only the fresh prefix may satisfy find_package: no package registries.
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
run("configure consumer" "${CMAKE_COMMAND}" ${configure_args})

file(STRINGS "${build}/CMakeCache.txt" dir_line REGEX "^flashattn_DIR:")
string(FIND "${dir_line}" "${prefix}/" pos)
if(NOT pos GREATER -1)
  message(FATAL_ERROR "find_package(flashattn) did not use the installed package: ${dir_line}")
endif()

run("build consumer" "${CMAKE_COMMAND}" --build "${build}" --config "${CONFIG}")
run("run consumer" "${build}/consumer")
message(STATUS "${last_output}")
