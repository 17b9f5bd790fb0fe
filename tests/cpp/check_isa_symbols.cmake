# ctest isa_symbols: the per-ISA kernel objects (csrc/core/isa.h) define no
# weak symbol outside their own ISA namespace.  The linker keeps one copy of
# each weak symbol, and the copy it keeps could be an AVX-512 one serving the
# portable path on a CPU without AVX-512.
#   cmake -DNM=<nm> -DOBJECTS="<isa>=<object>;..." -P check_isa_symbols.cmake
set(bad "")
foreach(entry IN LISTS OBJECTS)
  string(REPLACE "=" ";" pair "${entry}")
  list(GET pair 0 isa)
  list(GET pair 1 object)
  execute_process(COMMAND ${NM} -C --defined-only ${object} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "cannot read the symbols of ${object}")
  endif()
  string(REPLACE "\n" ";" lines "${symbols}")
  foreach(line IN LISTS lines)
    # Weak (W, V) and unique (u) symbols, demangled (a template may start with
    # its return type); DW.ref.__gxx_personality_v0 is the
    # exception-handling personality reference every C++ object carries.
    if(line MATCHES "^[0-9a-f]* [WVu] (.*)$")
      set(name "${CMAKE_MATCH_1}")
      if(NOT name MATCHES "(^| )nexuskv::core::${isa}::" AND NOT name STREQUAL "DW.ref.__gxx_personality_v0")
        string(APPEND bad "  ${object}: ${name}\n")
      endif()
    endif()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "weak symbols outside their ISA namespace (see csrc/core/isa.h):\n${bad}")
endif()
message(STATUS "per-ISA objects: no weak symbol outside their ISA namespace")
