cmake_minimum_required(VERSION 3.16)  # IN_LIST and other policies in script mode
# Checks the dynamic symbol table of libflashattn: it must export the C ABI (flashattn_*) and the
# C++ API (namespace flashattn), and nothing else: no std:: template instantiations, no symbols of
# statically linked libraries, no internals of the backends.
#
#   cmake -DLIB=<path to libflashattn.so> -DNM=<nm> -P check_exports.cmake
if(NOT LIB OR NOT NM)
  message(FATAL_ERROR "usage: cmake -DLIB=<libflashattn.so> -DNM=<nm> -P check_exports.cmake")
endif()
execute_process(COMMAND "${NM}" -D --defined-only "${LIB}"
                OUTPUT_VARIABLE listing ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIB} failed (${rc}): ${err}")
endif()

string(REPLACE "\n" ";" lines "${listing}")
set(exported "")
set(bad "")
foreach(line IN LISTS lines)
  # "<address> <type> <name>[@version]"
  if(NOT line MATCHES "^[0-9a-fA-F]+ ([A-Za-z]) ([^ @]+)")
    continue()
  endif()
  set(type "${CMAKE_MATCH_1}")
  set(name "${CMAKE_MATCH_2}")
  # Absolute symbols (type A) are version-node markers, not code or data.
  if(type STREQUAL "A")
    continue()
  endif()
  list(APPEND exported "${name}")
  if(name MATCHES "^flashattn_")                   # C ABI
  elseif(name MATCHES "^_ZN9flashattn")            # flashattn::... functions and data
  elseif(name MATCHES "^_ZT[ISV]N9flashattn")      # typeinfo / name / vtable of flashattn types
  elseif(name MATCHES "^_ZNK9flashattn")           # const member functions
  else()
    list(APPEND bad "${type} ${name}")
  endif()
endforeach()

foreach(required flashattn_forward flashattn_backward flashattn_last_error flashattn_options_init
                 flashattn_status_string flashattn_version flashattn_cuda_available)
  if(NOT required IN_LIST exported)
    list(APPEND bad "missing: ${required}")
  endif()
endforeach()
# The documented C++ API: flashattn::forward, flashattn::backward, flashattn::Error (and its
# typeinfo, so callers can catch it), Tensor factories.
foreach(prefix _ZN9flashattn7forward _ZN9flashattn8backward _ZN9flashattn5ErrorC
               _ZTIN9flashattn5ErrorE _ZN9flashattn6Tensor10contiguous _ZN9flashattn6Tensor4bshd)
  set(found FALSE)
  foreach(name IN LISTS exported)
    string(FIND "${name}" "${prefix}" pos)
    if(pos EQUAL 0)
      set(found TRUE)
      break()
    endif()
  endforeach()
  if(NOT found)
    list(APPEND bad "missing: a symbol starting with ${prefix}")
  endif()
endforeach()

list(LENGTH exported n)
if(bad)
  list(JOIN bad "\n  " text)
  message(FATAL_ERROR "${LIB}: ${n} exported symbols; unexpected or missing:\n  ${text}")
endif()
message(STATUS "${LIB}: ${n} exported symbols, all flashattn_* or flashattn::")
