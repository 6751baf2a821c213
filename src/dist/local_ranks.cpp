#include "dist/local_ranks.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "util/error.h"
#include "util/files.h"

extern char** environ;

namespace headroom {
namespace {

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

// A port the kernel says is free now (another process may take it before rank 0 binds it: rare).
int free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) fail("cannot open a socket to find a free port: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  if (port < 0) fail("cannot find a free loopback port: {}", std::strerror(errno));
  return port;
}

bool LocalRanksResult::ok() const {
  for (int c : exit_codes) {
    if (c != 0) return false;
  }
  return !exit_codes.empty();
}

LocalRanksResult run_local_ranks(int ranks, const std::vector<std::string>& args) {
  const char* given = std::getenv("HEADROOM_EXECUTABLE");
  if (given == nullptr || *given == '\0') {
    fail("cannot start ranks: HEADROOM_EXECUTABLE does not name the headroom binary (the CLI sets it)");
  }
  const std::string exe = given;
  if (::access(exe.c_str(), X_OK) != 0) fail("cannot start ranks: '{}' is not an executable", exe);
  char dir_template[] = "/tmp/headroom-ranks-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) fail("cannot create a temporary directory: {}", std::strerror(errno));
  const std::string dir = dir_template;
  const std::string port = std::to_string(free_loopback_port());
  // Everything the child needs is made before fork(): between fork and exec a child of a
  // multithreaded process may only make async-signal-safe calls.
  std::vector<std::string> inherited;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (key != "RANK" && key != "LOCAL_RANK" && key != "WORLD_SIZE" && key != "MASTER_ADDR" &&
        key != "MASTER_PORT" && key != "TORCHELASTIC_USE_AGENT_STORE") {
      inherited.push_back(kv);
    }
  }
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(exe.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    const std::string out = dir + "/out" + std::to_string(r), err = dir + "/err" + std::to_string(r);
    std::vector<std::string> env = inherited;
    for (const auto& kv : {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
                           "WORLD_SIZE=" + std::to_string(ranks), std::string("MASTER_ADDR=127.0.0.1"),
                           "MASTER_PORT=" + port}) {
      env.push_back(kv);
    }
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) fail("cannot start rank {}: {}", r, std::strerror(errno));
    if (pid == 0) {
      const int o = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      const int in = ::open("/dev/null", O_RDONLY);
      if (o < 0 || e < 0 || in < 0 || ::dup2(o, 1) < 0 || ::dup2(e, 2) < 0 || ::dup2(in, 0) < 0) ::_exit(127);
      ::execve(exe.c_str(), argv.data(), envp.data());
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  LocalRanksResult result;
  for (int r = 0; r < ranks; ++r) {
    int status = 0;
    while (::waitpid(pids[static_cast<size_t>(r)], &status, 0) < 0 && errno == EINTR) {
    }
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.exit_codes.push_back(code);
    if (code != 0 && result.first_error.empty()) {
      result.first_error = last_line(read_all(dir + "/err" + std::to_string(r)));
      if (result.first_error.empty()) result.first_error = fmt::format("rank {} exited with status {}", r, code);
    }
  }
  result.rank0_stdout = read_all(dir + "/out0");
  // By hand: libtorch exports a std::filesystem::remove_all of its own that crashes when called from here.
  for (int r = 0; r < ranks; ++r) {
    ::unlink((dir + "/out" + std::to_string(r)).c_str());
    ::unlink((dir + "/err" + std::to_string(r)).c_str());
  }
  ::rmdir(dir.c_str());
  return result;
}

}  // namespace headroom
