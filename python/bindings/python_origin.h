// Python origins — where in the user's Python code each CPU allocation was made.
//
// While enabled, the budget allocator asks, at each allocation, for the innermost Python frame
// outside the packages being skipped (torch's and headroom's own): "train.py:42 in main". Only a
// thread that has run Python is asked (OpenMP's and other native workers get no origin, and never
// wait for the GIL); it takes the GIL for the walk. Each distinct place gets a small id, kept in the
// allocation's record, that origin_name() turns back into text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace headroom::python {

// Frames whose file lies under one of `prefixes` are skipped (the caller names torch's and its own).
void set_skipped_prefixes(std::vector<std::string> prefixes);
// On while at least one caller holds it on (each Monitor on cpu with python_frames).
void enable_origins(bool on);
// "file:line in function" for an id from the allocator's records; "" for 0 or an unknown id.
std::string origin_name(uint32_t id);

}  // namespace headroom::python
