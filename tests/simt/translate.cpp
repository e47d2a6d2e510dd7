// simt_translate IN.cu OUT.cpp: rewrites the two pieces of CUDA syntax a host C++ compiler cannot
// parse, so that kernels/*.cu compile unchanged against the emulator in simt.h, and marks static
// shared variables so that the emulator can poison them before every block:
//
//   kernel<<<grid, block, smem, stream>>>(args);
//     -> ::simt::launch("kernel", ::simt::Config{grid, block, smem, stream},
//                       [&] { kernel(args); });
//   extern __shared__ __align__(16) unsigned char smem_raw[];
//     -> unsigned char* smem_raw = static_cast<unsigned char*>(::simt::dynamic_shared());
//   __shared__ float red[33];
//     -> __shared__ float red[33]; [[maybe_unused]] const bool simt_shared_red =
//            ::simt::static_shared(&red, sizeof(red));   (on the same line)
//
// Everything else is copied byte for byte, newlines included, and a #line directive names the
// original file, so compiler messages point at the .cu source.
#include <cctype>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace {

bool is_ident(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
}

[[noreturn]] void fail(const std::string& file, const std::string& text, size_t at,
                       const std::string& what) {
  size_t line = 1;
  for (size_t i = 0; i < at && i < text.size(); ++i) line += text[i] == '\n';
  throw std::runtime_error(file + ":" + std::to_string(line) + ": " + what);
}

// Index of the bracket closing the one at `open` (same kind), skipping nested pairs.
size_t matching(const std::string& s, size_t open, char o, char c) {
  int depth = 0;
  for (size_t i = open; i < s.size(); ++i) {
    if (s[i] == o) ++depth;
    if (s[i] == c && --depth == 0) return i;
  }
  return std::string::npos;
}

// Start of the kernel expression that ends just before `end` (exclusive): a possibly qualified
// name, possibly followed by template arguments, e.g. `ns::kernel<T, 4>`.
size_t kernel_start(const std::string& s, size_t end) {
  size_t i = end;
  while (i > 0 && std::isspace(static_cast<unsigned char>(s[i - 1]))) --i;
  if (i > 0 && s[i - 1] == '>') {
    int depth = 0;
    while (i > 0) {
      --i;
      if (s[i] == '>') ++depth;
      if (s[i] == '<' && --depth == 0) break;
    }
  }
  while (i > 0 && (is_ident(s[i - 1]) || s[i - 1] == ':')) --i;
  return i;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\n");
  const size_t e = s.find_last_not_of(" \t\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

std::string rewrite_launches(const std::string& file, const std::string& in) {
  std::string out;
  size_t copied = 0;
  for (size_t at = in.find("<<<"); at != std::string::npos; at = in.find("<<<", at + 3)) {
    const size_t start = kernel_start(in, at);
    if (start < copied || start == at) fail(file, in, at, "no kernel name before <<<");
    const std::string kernel = trim(in.substr(start, at - start));
    const size_t cfg_end = in.find(">>>", at);
    if (cfg_end == std::string::npos) fail(file, in, at, "<<< without >>>");
    const std::string config = in.substr(at + 3, cfg_end - at - 3);
    size_t open = cfg_end + 3;
    while (open < in.size() && std::isspace(static_cast<unsigned char>(in[open]))) ++open;
    if (open >= in.size() || in[open] != '(') fail(file, in, at, "launch without arguments");
    const size_t close = matching(in, open, '(', ')');
    if (close == std::string::npos) fail(file, in, open, "unbalanced launch arguments");
    std::string name = kernel;
    for (char& c : name)
      if (c == '\n') c = ' ';
    out += in.substr(copied, start - copied);
    out += "::simt::launch(\"" + name + "\", ::simt::Config{" + config + "}, [&] { " + name +
           in.substr(open, close + 1 - open) + "; })";
    // The newlines of the name and before <<< are kept, so later lines keep their numbers.
    for (size_t i = start; i < at; ++i)
      if (in[i] == '\n') out += '\n';
    copied = close + 1;
    at = close;
  }
  return out + in.substr(copied);
}

// The declaration from the end of `key` (at `at`) to its semicolon, without any __align__(n).
std::string declaration_after(const std::string& file, const std::string& in, size_t at,
                              const std::string& key, size_t* semi) {
  *semi = in.find(';', at);
  if (*semi == std::string::npos) fail(file, in, at, "unterminated " + key + " declaration");
  std::string decl = in.substr(at + key.size(), *semi - at - key.size());
  const size_t align = decl.find("__align__(");
  if (align != std::string::npos)
    decl.erase(align, matching(decl, align + 9, '(', ')') + 1 - align);
  return decl;
}

std::string rewrite_dynamic_shared(const std::string& file, const std::string& in) {
  const std::string key = "extern __shared__";
  std::string out;
  size_t copied = 0;
  for (size_t at = in.find(key); at != std::string::npos; at = in.find(key, at + 1)) {
    size_t semi = 0;
    const std::string decl = declaration_after(file, in, at, key, &semi);
    const size_t bracket = decl.rfind("[]");
    if (bracket == std::string::npos)
      fail(file, in, at, "extern __shared__ must be an array T x[]");
    size_t name_begin = bracket;
    while (name_begin > 0 && is_ident(decl[name_begin - 1])) --name_begin;
    const std::string name = decl.substr(name_begin, bracket - name_begin);
    const std::string type = trim(decl.substr(0, name_begin));
    if (name.empty() || type.empty()) fail(file, in, at, "cannot parse extern __shared__");
    out += in.substr(copied, at - copied);
    out += type + "* " + name + " = static_cast<" + type + "*>(::simt::dynamic_shared())";
    copied = semi;
  }
  return out + in.substr(copied);
}

// The static `__shared__ T name[...];` declarations (what is left after the dynamic ones are
// rewritten) that begin a statement; anything else naming __shared__ is left alone.
std::string mark_static_shared(const std::string& file, const std::string& in) {
  const std::string key = "__shared__";
  std::string out;
  size_t copied = 0;
  for (size_t at = in.find(key); at != std::string::npos; at = in.find(key, at + 1)) {
    size_t before = at;
    while (before > 0 && std::isspace(static_cast<unsigned char>(in[before - 1]))) --before;
    if (before > 0 && std::string(";{}").find(in[before - 1]) == std::string::npos) continue;
    size_t semi = 0;
    const std::string decl = declaration_after(file, in, at, key, &semi);
    if (decl.find_first_of("=({") != std::string::npos)
      fail(file, in, at, "cannot parse __shared__ declaration");
    size_t name_end = decl.find('[');
    if (name_end == std::string::npos) name_end = decl.size();
    while (name_end > 0 && !is_ident(decl[name_end - 1])) --name_end;
    size_t name_begin = name_end;
    while (name_begin > 0 && is_ident(decl[name_begin - 1])) --name_begin;
    const std::string name = decl.substr(name_begin, name_end - name_begin);
    if (name.empty()) fail(file, in, at, "cannot parse __shared__ declaration");
    out += in.substr(copied, semi + 1 - copied);
    out += " [[maybe_unused]] const bool simt_shared_" + name + " = ::simt::static_shared(&" +
           name + ", sizeof(" + name + "));";
    copied = semi + 1;
    at = semi;
  }
  return out + in.substr(copied);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: simt_translate IN.cu OUT.cpp\n";
    return 2;
  }
  try {
    std::ifstream in(argv[1], std::ios::binary);
    if (!in) throw std::runtime_error(std::string("cannot read ") + argv[1]);
    std::stringstream text;
    text << in.rdbuf();
    const std::string result = mark_static_shared(
        argv[1], rewrite_dynamic_shared(argv[1], rewrite_launches(argv[1], text.str())));
    std::ofstream out(argv[2], std::ios::binary);
    out << "#line 1 \"" << argv[1] << "\"\n" << result;
    if (!out) throw std::runtime_error(std::string("cannot write ") + argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "simt_translate: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
