#include "report/html_page.h"

#include <fmt/format.h>

namespace headroom {

std::string html_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string html_page_head(const std::string& title) {
  return fmt::format(R"(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; max-width: 960px; }}
h1 {{ font-size: 1.5em; }} h2 {{ font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ padding: 3px 8px; border-bottom: 1px solid #eee; text-align: left; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }} .bad {{ color: #b00; font-weight: bold; }} .good {{ color: #070; }}
pre {{ background: #f6f6f6; padding: 0.8em; overflow-x: auto; }}
</style></head><body>
)",
                     html_escape(title));
}

std::string svg_open(const std::string& id, double width, double height) {
  return fmt::format(
      R"(<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{}" width="{}" height="{}" viewBox="0 0 {} {}">)",
      id, width, height, width, height);
}

}  // namespace headroom
