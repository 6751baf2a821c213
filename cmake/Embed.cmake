# headroom_embed(OUTPUT file.cpp CORPUS corpus.txt PRESETS a.json b.json ...)
# Writes a C++ source defining the functions declared in src/data/embedded.h, holding the corpus
# and each preset as raw string literals. Regenerated when any input changes.
function(headroom_embed)
  cmake_parse_arguments(E "" "OUTPUT;CORPUS" "PRESETS" ${ARGN})
  string(REPLACE ";" "|" presets "${E_PRESETS}")
  add_custom_command(
    OUTPUT ${E_OUTPUT}
    COMMAND ${CMAKE_COMMAND} -DOUTPUT=${E_OUTPUT} -DCORPUS=${E_CORPUS} "-DPRESETS=${presets}"
            -P ${CMAKE_SOURCE_DIR}/cmake/EmbedScript.cmake
    DEPENDS ${E_CORPUS} ${E_PRESETS} ${CMAKE_SOURCE_DIR}/cmake/EmbedScript.cmake
    COMMENT "Embedding corpus and model presets" VERBATIM)
endfunction()
