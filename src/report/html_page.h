// The pieces every headroom HTML report shares (the doctor's, analyze's): escaping, the page's head
// and style, and the opening tag of an inline SVG chart. Pages are self-contained: no scripts, no
// network, charts drawn as inline SVG.
#pragma once

#include <string>

namespace headroom {

// Text made safe for HTML element content and attribute values.
std::string html_escape(const std::string& s);
// "<!DOCTYPE html>…<body>" with the shared style and `title` (escaped here).
std::string html_page_head(const std::string& title);
// An <svg> start tag of class "chart" with the id and size given.
std::string svg_open(const std::string& id, double width, double height);

}  // namespace headroom
