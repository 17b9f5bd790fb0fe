# ctest isa_symbols: the per-ISA kernel objects (csrc/core/isa.h) define no
# symbol with external linkage, weak or strong, outside their own ISA
# namespace nexuskv::core::<isa>.  The linker keeps one copy of each weak
# (COMDAT) symbol, and the copy it keeps could be an AVX-512 one serving the
# portable path on a CPU without AVX-512; a strong one would be a duplicate
# definition or, worse, the one every caller gets.  What the optimizer leaves
# out of line differs by build type (-O0 keeps std::min, -O2 keeps some
# helpers that -O3 inlines), so this runs in every build type: Release,
# RelWithDebInfo, Debug, MinSizeRel, and the sanitizer build (scripts/sanitize.sh, -O1:
# more out of line than -O2; CI's builds are that and Release).
#   cmake -DNM=<nm> -DOBJECTS="<isa>=<object>;..." -P check_isa_symbols.cmake
# The names are checked mangled (Itanium ABI), where "in the ISA namespace"
# is a prefix and cannot be confused with a parameter type.
set(bad "")
set(checked 0)
foreach(entry IN LISTS OBJECTS)
  string(REPLACE "=" ";" pair "${entry}")
  list(GET pair 0 isa)
  list(GET pair 1 object)
  # POSIX format: "name type value size", one symbol a line.
  execute_process(COMMAND ${NM} --defined-only -P ${object} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "cannot read the symbols of ${object}")
  endif()
  string(LENGTH "${isa}" isa_len)
  # In namespace nexuskv::core::<isa>: a function or variable (N, with cv- and
  # ref-qualifiers of a member function), a local static or its guard (Z, GVZ),
  # a vtable, typeinfo or its name (TV, TI, TS) or a TLS wrapper (TH, TW).
  set(own "^_Z(Z|GVZ|TV|TI|TS|TH|TW)?N[rVK]*[RO]?7nexuskv4core${isa_len}${isa}")
  string(REPLACE "\n" ";" lines "${symbols}")
  foreach(line IN LISTS lines)
    # Global types: upper case (T text, D/B/R data, W/V weak, C common, ...)
    # and u (GNU unique), i (GNU ifunc); lower case is local.  N (debug) and U
    # (undefined) are not definitions.
    if(line MATCHES "^([^ ]+) ([A-MO-TV-Zui]) ")
      set(name "${CMAKE_MATCH_1}")
      set(type "${CMAKE_MATCH_2}")
      math(EXPR checked "${checked} + 1")
      # DW.ref.__gxx_personality_v0: the exception-handling personality
      # reference every C++ object with unwinding carries (data, not code).
      if(NOT name MATCHES "${own}" AND NOT name STREQUAL "DW.ref.__gxx_personality_v0")
        string(APPEND bad "  ${type} ${name}    (${object})\n")
      endif()
    endif()
  endforeach()
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "no global symbol in the per-ISA objects: is OBJECTS right? (${OBJECTS})")
endif()
if(bad)
  # Demangled, for the reader, when binutils' c++filt is there.
  find_program(CXXFILT c++filt)
  if(CXXFILT)
    file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/isa_symbols_bad.txt "${bad}")
    execute_process(COMMAND ${CXXFILT} INPUT_FILE ${CMAKE_CURRENT_BINARY_DIR}/isa_symbols_bad.txt
                    OUTPUT_VARIABLE bad_demangled)
    set(bad "${bad_demangled}")
  endif()
  message(FATAL_ERROR "symbols with external linkage outside their ISA namespace "
                      "(csrc/core/isa.h says why and how to avoid them):\n${bad}")
endif()
message(STATUS "per-ISA objects: ${checked} global symbols, all in their ISA namespace")
