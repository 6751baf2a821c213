// The doctor's report as one self-contained HTML page: no scripts, no network, charts as inline
// SVG — memory over time with the phases marked, the breakdown measured against estimated, and
// each lever's peak against the budget — with the lever table and the plan.
#pragma once

#include <string>

#include "doctor/doctor.h"

namespace headroom {

std::string report_html(const DoctorReport& report);

}  // namespace headroom
