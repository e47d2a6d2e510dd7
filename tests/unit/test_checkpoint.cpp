// Training checkpoints on one rank: the file format (every tensor at full shape, also for
// h5ls/h5dump), bitwise resume, refusal of damaged checkpoints with fallback, keep_last, a stop
// by SIGTERM and a save killed part-way. Children are this test binary run again (a fresh
// process: forking a process that already ran OpenMP code is not safe).
#include <fcntl.h>
#include <gtest/gtest.h>

#include <hdf5.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include "expect_error.h"
#include "temp_dir.h"
#include "tiny_run.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "shardtrain/backend/backend.h"
#include "shardtrain/dist/process_group.h"
#include "shardtrain/io/checkpoint.h"
#include "shardtrain/io/safetensors.h"
#include "shardtrain/train/checkpointing.h"
#include "shardtrain/train/output_dir.h"
#include "shardtrain/train/run_lock.h"
#include "shardtrain/train/runtime.h"
#include "shardtrain/train/trainer.h"

extern char** environ;

using namespace shardtrain;
namespace fs = std::filesystem;

namespace {

constexpr const char* kChildEnv = "SHARDTRAIN_TEST_CHILD_CONFIG";

using shardtrain::testing::expect_error;
using shardtrain::testing::TempDir;

// The shared tiny run with 4 sequences per step (one micro-batch) and a cosine schedule. Built
// for the emulated GPU (tests/simt), SHARDTRAIN_TEST_DEVICE moves every run onto it.
// Writes an int64 attribute of the object at `object` ("/", "amp/grad_scaler") of an HDF5 file.
// HDF5 ends the file at its own end when it closes it: a checkpoint's checksum trailer goes.
void set_int_attribute(const std::string& path, const std::string& object, const std::string& name,
                       int64_t value) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  hid_t o = H5Oopen(f, object.c_str(), H5P_DEFAULT);
  ASSERT_GE(o, 0) << object;
  hid_t a = H5Aopen(o, name.c_str(), H5P_DEFAULT);
  ASSERT_GE(a, 0) << name;
  EXPECT_GE(H5Awrite(a, H5T_NATIVE_INT64, &value), 0);
  H5Aclose(a);
  H5Oclose(o);
  H5Fclose(f);
}

train::Config tiny_config(const std::string& out_dir, std::vector<std::string> overrides = {}) {
  overrides.insert(overrides.begin(), {"train.micro_batch=4", "train.global_batch=4",
                                       "optim.schedule=cosine", "train.out_dir=" + out_dir});
#ifdef SHARDTRAIN_TEST_DEVICE
  overrides.insert(overrides.begin(), std::string("train.device=") + SHARDTRAIN_TEST_DEVICE);
#endif
  return train::Config::parse(shardtrain::testing::kTinyRunYaml, overrides, "test_checkpoint");
}

std::map<int64_t, double> step_losses(const std::string& metrics_path) {
  return shardtrain::testing::read_step_losses(metrics_path);
}

std::string file_bytes(const std::string& path) {
  return shardtrain::testing::read_file_bytes(path);
}

std::string run_command(const std::string& command, int* exit_code = nullptr) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return out;
  char buf[4096];
  size_t got = 0;
  while ((got = fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, got);
  int status = pclose(pipe);
  if (exit_code != nullptr) *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

bool have_tool(const std::string& name) {
  int code = -1;
  run_command("command -v " + name + " >/dev/null 2>&1", &code);
  return code == 0;
}

// ---- children ---------------------------------------------------------------------------------

// Runs this test binary again, as CheckpointChild.DISABLED_RunTraining on `config`, with stdout
// and stderr going to `log_path`. A `file_size_limit` (bytes) makes every write past it fail as
// on a full disk (EFBIG; SIGXFSZ ignored).
pid_t spawn_training_child(const train::Config& config, const std::string& dir,
                           const std::string& log_path, rlim_t file_size_limit = RLIM_INFINITY) {
  const std::string config_path = dir + "/child.yaml";
  std::ofstream(config_path) << config.to_yaml();
  // Everything the child needs is built before fork: only async-signal-safe calls follow it.
  std::vector<std::string> env_strings;
  const std::string own_variable = std::string(kChildEnv) + "=";
  for (char** e = environ; *e != nullptr; ++e)
    if (std::string_view(*e).substr(0, own_variable.size()) != own_variable)
      env_strings.push_back(*e);
  env_strings.push_back(std::string(kChildEnv) + "=" + config_path);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = fs::read_symlink("/proc/self/exe").string();
  std::string filter = "--gtest_filter=CheckpointChild.DISABLED_RunTraining";
  std::string disabled = "--gtest_also_run_disabled_tests";
  char* argv[] = {exe.data(), filter.data(), disabled.data(), nullptr};
  pid_t pid = fork();
  if (pid == 0) {
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    ::signal(SIGHUP, SIG_DFL);  // an ignored SIGHUP (nohup) would outlive execve
    if (file_size_limit != RLIM_INFINITY) {
      const struct rlimit limit = {file_size_limit, file_size_limit};
      setrlimit(RLIMIT_FSIZE, &limit);
      signal(SIGXFSZ, SIG_IGN);  // kept across execve
    }
    execve(exe.c_str(), argv, envp.data());
    _exit(127);
  }
  return pid;
}

// Exit code, or 128 + signal.
int wait_child(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Waits (up to 120 s) until `ready` holds; false on timeout.
template <typename Pred>
bool wait_until(Pred ready) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    if (ready()) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return false;
}

// spawn_training_child, then waits (up to 120 s) for its first line: by then its stop-signal
// handlers and its directory lock are in place (both come before the model is built). -1 when
// the line never came (the child is killed).
pid_t spawn_started_child(const train::Config& config, const std::string& dir,
                          const std::string& log_path) {
  const pid_t child = spawn_training_child(config, dir, log_path);
  if (child <= 0) return -1;
  if (wait_until([&] { return file_bytes(log_path).find("parameters on") != std::string::npos; }))
    return child;
  kill(child, SIGKILL);
  wait_child(child);
  return -1;
}

}  // namespace

// Not a test of its own: the body of the child processes above.
TEST(CheckpointChild, DISABLED_RunTraining) {
  const char* path = std::getenv(kChildEnv);
  if (path == nullptr) GTEST_SKIP() << "run by the tests below";
  train::TrainSummary s = train::run_training(train::load_config(path));
  std::printf("child finished: %lld steps, stopped_early %d, checkpoint %s\n",
              static_cast<long long>(s.steps), s.stopped_early ? 1 : 0, s.last_checkpoint.c_str());
}

// ---- format -----------------------------------------------------------------------------------

TEST(CheckpointFormat, HoldsEveryTensorAtFullShapeAndTheTrainingState) {
  TempDir tmp;
  // The export in bf16: the checkpoint keeps the fp32 weights it is rounded from.
  train::Config config = tiny_config(
      tmp / "run", {"train.steps=3", "checkpoint.every_steps=3", "train.export_dtype=bf16"});
#ifdef SHARDTRAIN_TEST_DEVICE
  ASSERT_TRUE(cuda_backend_available());
  allocator_for(Device::cuda(0)).reset_peak();
#endif
  train::TrainSummary summary = train::run_training(config);
#ifdef SHARDTRAIN_TEST_DEVICE
  // The run's parameters and activations lived on the device.
  EXPECT_GT(allocator_for(Device::cuda(0)).stats().peak_of(MemoryCategory::Parameters), 0);
  EXPECT_GT(allocator_for(Device::cuda(0)).stats().peak_of(MemoryCategory::Activations), 0);
#endif
  const std::string path = tmp / "run/checkpoints/step-00000003.h5";
  ASSERT_EQ(summary.last_checkpoint, path);
  ASSERT_TRUE(fs::exists(tmp / "run/checkpoints/step-00000003.rank-0.h5"));

  io::CheckpointReader reader(path);
  const io::TrainingState& s = reader.state();
  EXPECT_EQ(s.step, 3);
  EXPECT_EQ(s.world_size, 1);
  EXPECT_EQ(s.optimizer, "adamw");
  EXPECT_EQ(s.optimizer_steps, 3);
  EXPECT_EQ(s.sampler.epoch, 0);
  EXPECT_EQ(s.sampler.position, 3 * 4);  // 3 steps of 4 windows
  EXPECT_EQ(s.sampler.seed, 1234u);      // data.seed
  EXPECT_EQ(s.init_seed, 7u);
  EXPECT_EQ(s.sharding, "none");
  EXPECT_FALSE(s.scaler_enabled);
  EXPECT_EQ(train::Config::parse(s.config_yaml), config);
  // Step 3 (0-based 2) of 5 warm-up steps to optim.lr 3e-3: 3e-3 * 3 / 5.
  EXPECT_FLOAT_EQ(static_cast<float>(s.lr), 1.8e-3f);

  // The weights are the final weights of the run (its export, rounded to bf16), at full shape
  // and in fp32; the moments too.
  SafetensorsFile export_file = SafetensorsFile::open(summary.export_dir + "/model.safetensors");
  std::map<std::string, Tensor> exported;
  for (const std::string& name : export_file.names()) exported[name] = export_file.load(name);
  ASSERT_FALSE(exported.empty());
  for (const auto& [name, weights] : exported) {
    ASSERT_TRUE(reader.has("model/" + name)) << name;
    EXPECT_EQ(weights.dtype(), DType::BF16) << name;
    EXPECT_EQ(reader.shape("model/" + name), weights.shape()) << name;
    const Tensor saved = reader.read("model/" + name);
    EXPECT_EQ(saved.dtype(), DType::F32) << name;
    std::vector<float> rounded = saved.to_float_vector();
    for (float& x : rounded) x = bf16_to_float(float_to_bf16(x));
    EXPECT_EQ(rounded, weights.to_float_vector()) << name;
    for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
      const std::string key = std::string("optim/") + kind + "/" + name;
      ASSERT_TRUE(reader.has(key)) << key;
      EXPECT_EQ(reader.shape(key), weights.shape()) << key;
    }
  }
  EXPECT_EQ(reader.tensor_names().size(), 3 * exported.size());
  // A flat range across rows of a 2-d tensor: partial first row, whole rows, partial last row.
  const std::string embed = "model/model.embed_tokens.weight";
  std::vector<float> all = reader.read(embed).to_float_vector();
  Tensor part = empty({75}, DType::F32, Device::cpu());
  reader.read_range(embed, 29, part);
  EXPECT_EQ(part.to_float_vector(), std::vector<float>(all.begin() + 29, all.begin() + 104));

  dist::LocalProcessGroup local;
  EXPECT_EQ(io::verify_checkpoint(local, path), "");

  // External tools see whole tensors through the virtual datasets.
  if (!have_tool("h5ls") || !have_tool("h5dump")) GTEST_SKIP() << "hdf5-tools not installed";
  std::string listing = run_command("h5ls -r " + path);
  for (const auto& [name, weights] : exported) {
    std::string dims;
    for (int64_t d : weights.shape()) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    for (std::string prefix : {"/model/", "/optim/exp_avg/", "/optim/exp_avg_sq/"}) {
      std::regex line(std::regex_replace(prefix + name, std::regex(R"([.])"), R"(\.)") +
                      R"(\s+Dataset \{)" + dims + R"(\})");
      EXPECT_TRUE(std::regex_search(listing, line)) << prefix << name << " [" << dims << "]\n"
                                                    << listing;
    }
  }
  std::string header = run_command("h5dump -H " + path);
  EXPECT_NE(header.find("DATASPACE  SIMPLE { ( 256, 32 ) / ( 256, 32 ) }"), std::string::npos)
      << header;
  // h5dump reads the data through the mapping as well.
  int code = -1;
  std::string values =
      run_command("h5dump -d /model/model.norm.weight -w 0 -m %.9g " + path, &code);
  ASSERT_EQ(code, 0) << values;
  // "(i): value" per element (-w 0: no wrapping), values with 9 significant digits.
  std::vector<float> dumped;
  const std::regex element(R"(\((\d+)\): ([-+0-9.eE]+))");
  ASSERT_NE(values.find("DATA {"), std::string::npos) << values;
  const size_t data_begin = values.find("DATA {");
  const std::string data = values.substr(data_begin, values.find('}', data_begin) - data_begin);
  for (auto it = std::sregex_iterator(data.begin(), data.end(), element);
       it != std::sregex_iterator(); ++it) {
    EXPECT_EQ(std::stoul((*it)[1].str()), dumped.size());
    dumped.push_back(std::stof((*it)[2].str()));
  }
  EXPECT_EQ(dumped, reader.read("model/model.norm.weight").to_float_vector());
}

// ---- bitwise resume ---------------------------------------------------------------------------

// What a case changes about the run, and the state a resume must restore for it to stay exact.
struct ResumeCase {
  std::string name;
  std::vector<std::string> overrides;
};

void PrintTo(const ResumeCase& c, std::ostream* os) {
  *os << c.name;
}

// The final trained weights: the export, or the adapter of a LoRA run.
std::string final_weights(const train::TrainSummary& s) {
  if (!s.export_dir.empty()) return file_bytes(s.export_dir + "/model.safetensors");
  return file_bytes(fs::path(s.metrics_path).parent_path() / "adapter/adapter_model.safetensors");
}

class ResumeIsBitwise : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(ResumeIsBitwise, TwentyStepsSavedAndResumedGiveTheFortyStepRun) {
  TempDir tmp;
  const ResumeCase& c = GetParam();
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), c.overrides.begin(), c.overrides.end());
    return extra;
  };
  train::TrainSummary ref = train::run_training(tiny_config(tmp / "ref", with({})));
  std::map<int64_t, double> ref_losses = step_losses(ref.metrics_path);
  ASSERT_EQ(ref_losses.size(), 40u);
  const std::string ref_weights = final_weights(ref);
  ASSERT_FALSE(ref_weights.empty());

  // Saving does not disturb the run.
  train::TrainSummary saving = train::run_training(
      tiny_config(tmp / "saving", with({"checkpoint.every_steps=20", "checkpoint.keep_last=0"})));
  EXPECT_EQ(step_losses(saving.metrics_path), ref_losses);
  const std::string at20 = tmp / "saving/checkpoints/step-00000020.h5";
  ASSERT_TRUE(fs::exists(at20));
  ASSERT_TRUE(fs::exists(tmp / "saving/checkpoints/step-00000040.h5"));
  io::CheckpointReader reader(at20);
  if (c.name == "fp16") {
    // The scaler's state is worth restoring: it has moved away from its initial value.
    EXPECT_TRUE(reader.state().scaler_enabled);
    EXPECT_NE(reader.state().scaler.scale, 65536.0f);
  }
  if (c.name == "lora_dropout") {
    // One dropout generator per adapted projection, advanced by 20 steps of masks.
    ASSERT_EQ(reader.state().rng.size(), 1u);
    ASSERT_EQ(reader.state().rng[0].size(), 2u * 7u);
    bool found = false;
    for (const io::GeneratorState& g : reader.state().rng[0]) {
      EXPECT_GT(g.offset, 0u) << g.name;
      found = found || g.name == "model.layers.0.self_attn.q_proj.lora_dropout";
    }
    EXPECT_TRUE(found);
    for (const std::string& name : reader.tensor_names())
      EXPECT_NE(name.find("lora_"), std::string::npos) << "a frozen weight was saved: " << name;
  }

  train::TrainSummary resumed =
      train::run_training(tiny_config(tmp / "resumed", with({"train.resume=" + at20})));
  std::map<int64_t, double> losses = step_losses(resumed.metrics_path);
  ASSERT_EQ(losses.size(), 20u);
  for (const auto& [step, loss] : losses) {
    EXPECT_GT(step, 20);
    EXPECT_EQ(loss, ref_losses.at(step)) << "step " << step;
  }
  EXPECT_TRUE(final_weights(resumed) == ref_weights)
      << "the final weights differ from the uninterrupted run's";
}

INSTANTIATE_TEST_SUITE_P(
    Runs, ResumeIsBitwise,
    ::testing::Values(ResumeCase{"fp32", {}},
                      ResumeCase{"fp16", {"precision.compute=fp16", "precision.growth_interval=3"}},
                      ResumeCase{"optimizer_offload", {"optim.offload=cpu"}},
                      ResumeCase{"sgd_momentum", {"optim.name=sgd", "optim.lr=0.05"}},
                      ResumeCase{
                          "lora_dropout",
                          {"lora.enabled=true", "lora.r=4", "lora.alpha=8", "lora.dropout=0.2"}}),
    [](const auto& info) { return info.param.name; });

// ---- damaged checkpoints ----------------------------------------------------------------------

TEST(CheckpointResume, AutoRefusesDamagedCheckpointsAndFallsBackToAnIntactOne) {
  TempDir tmp;
  const std::string dir = tmp / "run/checkpoints";
  train::TrainSummary first = train::run_training(tiny_config(
      tmp / "run", {"train.steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=0"}));
  std::map<int64_t, double> first_losses = step_losses(first.metrics_path);
  auto main_file = [&](int step) { return dir + "/" + io::checkpoint_file_name(step); };
  auto rank_file = [&](int step) { return dir + "/" + io::rank_file_name(step, 0); };

  // step 6: its rank file is gone.
  fs::remove(rank_file(6));
  // step 4: bytes in the middle of its rank file are overwritten.
  {
    std::fstream f(rank_file(4), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(rank_file(4)) / 2));
    f.write("\x5a\x5a\x5a\x5a\x5a\x5a\x5a\x5a", 8);
  }
  // step 8: a copy of step 2 whose save never finished (no `complete` attribute).
  fs::copy_file(main_file(2), main_file(8));
  {
    hid_t f = H5Fopen(main_file(8).c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    ASSERT_GE(H5Adelete(f, "complete"), 0);
    H5Fclose(f);
    io::reseal_checkpoint_file(main_file(8));  // else refused for its lost checksum alone
  }
  // step 10: a main file cut short.
  {
    std::string bytes = file_bytes(main_file(2));
    std::ofstream(main_file(10), std::ios::binary).write(bytes.data(), bytes.size() / 2);
  }
  // steps 12 and 14: copies of step 2 (sharing its rank file) whose attributes were damaged:
  // the saved config is gone (so model settings could not be compared), and world_size is -1.
  for (int step : {12, 14}) {
    fs::copy_file(main_file(2), main_file(step));
    fs::copy_file(rank_file(2), rank_file(step));
    hid_t f = H5Fopen(main_file(step).c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    if (step == 12) {
      ASSERT_GE(H5Adelete(f, "config"), 0);
    } else {
      hid_t a = H5Aopen(f, "world_size", H5P_DEFAULT);
      const int64_t minus_one = -1;
      ASSERT_GE(H5Awrite(a, H5T_NATIVE_INT64, &minus_one), 0);
      H5Aclose(a);
    }
    H5Fclose(f);
    io::reseal_checkpoint_file(main_file(step));
  }
  // step 16: a copy of step 2 with one bit flipped in its main file, where HDF5 keeps the
  // virtual datasets' mappings (a flip there once crashed the library); and step 18: a copy of
  // step 2 edited with HDF5 and not re-sealed (its checksum trailer is cut off).
  {
    fs::copy_file(main_file(2), main_file(16));
    fs::copy_file(rank_file(2), rank_file(16));
    std::fstream f(main_file(16), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(fs::file_size(main_file(16)) / 2));
    char byte = 0;
    f.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    f.seekp(static_cast<std::streamoff>(fs::file_size(main_file(16)) / 2));
    f.write(&byte, 1);
  }
  {
    fs::copy_file(main_file(2), main_file(18));
    fs::copy_file(rank_file(2), rank_file(18));
    hid_t f = H5Fopen(main_file(18).c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    H5Fclose(f);
    EXPECT_EQ(fs::file_size(main_file(18)) + 24, fs::file_size(main_file(2)))
        << "HDF5 no longer cuts the trailer when it closes a file opened for writing";
  }

  // step 22: a FIFO under a main file's name (opening it would block until a writer came).
  ASSERT_EQ(::mkfifo(main_file(22).c_str(), 0600), 0);

  dist::LocalProcessGroup local;
  EXPECT_EQ(io::verify_checkpoint(local, main_file(22)),
            "checkpoint file '" + main_file(22) +
                "' is not a regular file but a FIFO, device or socket: remove it, or name "
                "another checkpoint");
  std::string v10 = io::verify_checkpoint(local, main_file(10));
  EXPECT_NE(v10.find(main_file(10)), std::string::npos) << v10;
  std::string v8 = io::verify_checkpoint(local, main_file(8));
  EXPECT_NE(v8.find(main_file(8)), std::string::npos) << v8;
  EXPECT_NE(v8.find("incomplete"), std::string::npos) << v8;
  std::string v6 = io::verify_checkpoint(local, main_file(6));
  EXPECT_NE(v6.find(rank_file(6)), std::string::npos) << v6;
  EXPECT_NE(v6.find("missing"), std::string::npos) << v6;
  std::string v4 = io::verify_checkpoint(local, main_file(4));
  EXPECT_NE(v4.find(rank_file(4)), std::string::npos) << v4;
  std::printf("refusals:\n  %s\n  %s\n  %s\n  %s\n", v10.c_str(), v8.c_str(), v6.c_str(),
              v4.c_str());
  EXPECT_EQ(io::verify_checkpoint(local, main_file(16)),
            "'" + main_file(16) + "' does not match its whole-file checksum (damaged)");
  EXPECT_EQ(
      io::verify_checkpoint(local, main_file(18)),
      "'" + main_file(18) + "' has lost its whole-file checksum trailer (truncated or damaged)");
  // Re-sealing blesses an edit, never damage.
  EXPECT_THROW(io::reseal_checkpoint_file(main_file(16)), FormatError);
  EXPECT_EQ(io::verify_checkpoint(local, main_file(2)), "");

  // An explicit path to a damaged checkpoint is an error naming it.
  for (int step : {22, 18, 16, 14, 12, 10, 8, 6, 4}) {
    try {
      train::run_training(
          tiny_config(tmp / "explicit", {"train.steps=7", "train.resume=" + main_file(step)}));
      ADD_FAILURE() << "resumed from damaged " << main_file(step);
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(main_file(step)), std::string::npos) << e.what();
    }
  }

  // auto: refuses 22 to 4 (logging each) and continues from step 2 exactly.
  train::Config cfg =
      tiny_config(tmp / "run", {"train.steps=3", "train.resume=auto", "train.progress=lines"});
  ::testing::internal::CaptureStderr();
  train::TrainSummary resumed = train::run_training(cfg);
  std::string log = ::testing::internal::GetCapturedStderr();
  for (int step : {22, 18, 16, 14, 12, 10, 8, 6, 4})
    EXPECT_NE(log.find("refusing checkpoint " + main_file(step)), std::string::npos) << log;
  EXPECT_NE(log.find("resumed from " + main_file(2)), std::string::npos) << log;
  std::map<int64_t, double> losses = step_losses(resumed.metrics_path);
  // Steps 1 and 2 kept from the first run (the metrics file is shared), step 3 recomputed.
  ASSERT_EQ(losses.size(), 3u);
  EXPECT_EQ(losses.at(3), first_losses.at(3));

  // A main file renamed to another step is refused: its rank files are its own step's.
  fs::copy_file(main_file(2), main_file(20));
  EXPECT_EQ(io::verify_checkpoint(local, main_file(20)),
            "'" + main_file(20) +
                "' is damaged: its name says step 00000020 but it records step 2 (renamed?); its "
                "rank files are those of step 2");
  fs::remove(main_file(20));

  // A main file of format version 1 (before the trailer) still verifies.
  const fs::path old_dir = tmp / "version1";
  fs::create_directories(old_dir);
  const std::string old_main = (old_dir / io::checkpoint_file_name(2)).string();
  fs::copy_file(main_file(2), old_main);
  fs::copy_file(rank_file(2), old_dir / io::rank_file_name(2, 0));
  set_int_attribute(old_main, "/", "format_version", 1);
  EXPECT_EQ(io::verify_checkpoint(local, old_main), "");
}

// A rank file that is a FIFO (whose open would block until a writer came, a hang no stop signal
// ends) or a directory is refused by name, by an explicit resume and by auto alike.
TEST(CheckpointResume, ARankFileThatIsAFifoOrADirectoryIsRefusedWithoutBlocking) {
  TempDir tmp;
  const std::string dir = tmp / "run/checkpoints";
  train::run_training(tiny_config(tmp / "run", {"train.steps=2", "checkpoint.every_steps=2"}));
  const std::string main_file = dir + "/" + io::checkpoint_file_name(2);
  const std::string rank_file = dir + "/" + io::rank_file_name(2, 0);
  for (const bool fifo : {true, false}) {
    SCOPED_TRACE(fifo ? "FIFO" : "directory");
    fs::remove_all(rank_file);
    if (fifo)
      ASSERT_EQ(::mkfifo(rank_file.c_str(), 0600), 0);
    else
      fs::create_directory(rank_file);
    const std::string refusal = "checkpoint file '" + rank_file + "' is not a regular file but " +
                                (fifo ? "a FIFO, device or socket" : "a directory");
    expect_error<FormatError>(
        [&] {
          train::run_training(tiny_config(tmp / "explicit" + std::to_string(fifo),
                                          {"train.steps=3", "train.resume=" + main_file}));
        },
        {refusal});
    // auto passes it over, saying why (and, with no other checkpoint, starts from scratch).
    ::testing::internal::CaptureStderr();
    train::run_training(tiny_config(tmp / "auto" + std::to_string(fifo),
                                    {"train.steps=3", "train.resume=auto", "train.progress=lines",
                                     "checkpoint.dir=" + dir, "checkpoint.every_steps=0"}));
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("refusing checkpoint " + main_file), std::string::npos) << log;
    EXPECT_NE(log.find(refusal), std::string::npos) << log;
  }
}

// Replaces an attribute of the object at `object` of an HDF5 file with a scalar of another type.
void replace_attribute(const std::string& path, const std::string& object, const std::string& name,
                       hid_t type, const void* value) {
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << path;
  hid_t o = H5Oopen(f, object.c_str(), H5P_DEFAULT);
  ASSERT_GE(o, 0) << object;
  ASSERT_GE(H5Adelete(o, name.c_str()), 0) << name;
  hid_t space = H5Screate(H5S_SCALAR);
  hid_t a = H5Acreate2(o, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT);
  EXPECT_GE(H5Awrite(a, type, value), 0);
  H5Aclose(a);
  H5Sclose(space);
  H5Oclose(o);
  H5Fclose(f);
}

// State no run could have saved is refused when the checkpoint is verified, naming the file and
// the value, so that train.resume=auto falls back to an earlier checkpoint instead of stopping
// on it later (or, for a negative seed that HDF5 would read as 0, going on with another shuffle).
TEST(CheckpointResume, ImpossibleStateValuesAreRefusedAtVerification) {
  TempDir tmp;
  const std::string dir = tmp / "run/checkpoints";
  train::TrainSummary first = train::run_training(tiny_config(
      tmp / "run", {"train.steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=0"}));
  const std::string main4 = dir + "/" + io::checkpoint_file_name(4);
  const std::string pristine = tmp / "pristine.h5";
  fs::copy_file(main4, pristine);
  dist::LocalProcessGroup local;
  struct Damage {
    std::string object, name;
    hid_t type;
    double f64;
    int64_t i64;
    std::string expected;
  };
  const double nan = std::nan("");
  const std::vector<Damage> damages = {
      {"amp/grad_scaler", "scale", H5T_NATIVE_DOUBLE, nan, 0, "/amp/grad_scaler scale is nan"},
      {"amp/grad_scaler", "scale", H5T_NATIVE_DOUBLE, 1e-300, 0, "scale is 1e-300"},
      {"amp/grad_scaler", "scale", H5T_NATIVE_DOUBLE, -1, 0, "scale is -1"},
      {"amp/grad_scaler", "skipped_steps", H5T_NATIVE_INT64, 0, 5, "skipped_steps 5 at step 4"},
      {"data/train_sampler", "position", H5T_NATIVE_INT64, 0, -1, "position -1"},
      {"data/train_sampler", "epoch", H5T_NATIVE_INT64, 0, -2, "epoch -2"},
      {"data/train_sampler", "seed", H5T_NATIVE_INT64, 0, -7, "'seed' is -7"},
      {"data/train_sampler", "seed", H5T_NATIVE_DOUBLE, 0.5, 0, "'seed' is not an integer"},
      {"model/model.norm.weight", "piece_begin", H5T_NATIVE_INT64, 0, -1,
       "its pieces do not tile the"},
  };
  for (const Damage& d : damages) {
    SCOPED_TRACE(d.object + " " + d.name);
    fs::copy_file(pristine, main4, fs::copy_options::overwrite_existing);
    replace_attribute(main4, d.object, d.name, d.type,
                      d.type == H5T_NATIVE_DOUBLE ? static_cast<const void*>(&d.f64) : &d.i64);
    io::reseal_checkpoint_file(main4);
    const std::string problem = io::verify_checkpoint(local, main4);
    EXPECT_NE(problem.find(main4), std::string::npos) << problem;
    EXPECT_NE(problem.find(d.expected), std::string::npos) << problem;
  }
  // auto falls back to step 2 and goes on to the run's own losses.
  ::testing::internal::CaptureStderr();
  train::TrainSummary resumed = train::run_training(
      tiny_config(tmp / "run", {"train.steps=4", "train.resume=auto", "train.progress=lines"}));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("refusing checkpoint " + main4), std::string::npos) << log;
  EXPECT_NE(log.find("resumed from " + dir + "/" + io::checkpoint_file_name(2)), std::string::npos)
      << log;
  EXPECT_EQ(step_losses(resumed.metrics_path).at(4), step_losses(first.metrics_path).at(4));
}

// A generator the model draws from that the checkpoint holds no state for (a run that drew none,
// or a lost dataset) starts from its seed, and the resume says so: its draws are not those of an
// uninterrupted run.
TEST(CheckpointResume, AGeneratorTheCheckpointLacksIsNoted) {
  TempDir tmp;
  const std::vector<std::string> lora = {"lora.enabled=true", "lora.r=4", "lora.alpha=8",
                                         "lora.dropout=0.2", "checkpoint.every_steps=2"};
  std::vector<std::string> first = lora;
  first.push_back("train.steps=2");
  train::run_training(tiny_config(tmp / "run", first));
  const std::string main2 = tmp / ("run/checkpoints/" + io::checkpoint_file_name(2));
  const std::string lost = "rng/model.layers.0.mlp.down_proj.lora_dropout";
  {
    hid_t f = H5Fopen(main2.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    ASSERT_GE(H5Ldelete(f, lost.c_str(), H5P_DEFAULT), 0) << lost;
    H5Fclose(f);
  }
  io::reseal_checkpoint_file(main2);
  std::vector<std::string> resumed = lora;
  resumed.insert(resumed.end(), {"train.steps=3", "train.resume=auto", "train.progress=lines"});
  ::testing::internal::CaptureStderr();
  train::run_training(tiny_config(tmp / "run", resumed));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("resumed from " + main2), std::string::npos) << log;
  EXPECT_NE(log.find("holds no state for 1 random generator(s) the model draws from "
                     "(model.layers.0.mlp.down_proj.lora_dropout)"),
            std::string::npos)
      << log;
}

TEST(CheckpointResume, ACheckpointOfAnotherModelIsAClearError) {
  TempDir tmp;
  train::run_training(tiny_config(tmp / "run", {"train.steps=1", "checkpoint.every_steps=1"}));
  const std::string saved = "train.resume=" + std::string(tmp / "run/checkpoints/step-00000001.h5");
  auto refused = [&](std::vector<std::string> settings, const std::vector<std::string>& named) {
    settings.push_back("train.steps=2");
    settings.push_back(saved);
    try {
      train::run_training(tiny_config(tmp / "other", settings));
      ADD_FAILURE() << "resumed with " << settings.front();
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("other model settings"), std::string::npos) << e.what();
      for (const std::string& key : named)
        EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  refused({"model.hidden_size=64", "model.intermediate_size=96"},
          {"model.hidden_size: checkpoint 32, this run 64", "model.intermediate_size"});
  // The same tensor shapes: only the settings tell these apart.
  refused({"model.num_heads=8", "model.num_kv_heads=4"},
          {"model.num_heads: checkpoint 4, this run 8", "model.num_kv_heads"});
  refused({"model.rope_theta=500000"}, {"model.rope_theta"});
  // What does not define the weights may change.
  train::TrainSummary s = train::run_training(
      tiny_config(tmp / "longer", {"train.steps=2", "model.init_std=0.5", saved}));
  EXPECT_EQ(s.first_step, 1);
}

// A LoRA checkpoint holds the adapters, not the frozen base: resuming them on another base (here
// one initialised from another seed) would train from a wrong start without any other error.
TEST(CheckpointResume, LoraAdaptersResumeOnlyOnTheirBase) {
  TempDir tmp;
  const std::vector<std::string> lora = {"lora.enabled=true", "lora.r=4", "train.steps=1",
                                         "checkpoint.every_steps=1"};
  train::run_training(tiny_config(tmp / "run", lora));
  auto resume = [&](std::vector<std::string> settings) {
    settings.insert(settings.end(), lora.begin(), lora.end());
    settings.push_back("train.steps=2");
    settings.push_back("train.resume=auto");
    return train::run_training(tiny_config(tmp / "run", settings));
  };
  try {
    resume({"train.seed=8"});
    ADD_FAILURE() << "LoRA adapters resumed on a base from another seed";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("were trained on weights initialised from train.seed=7"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("this run's base is weights initialised from "
                                         "train.seed=8"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(resume({}).first_step, 1);
}

// A resumed run replaces only the evaluations it repeats: extending a finished run under another
// eval_every keeps the old run's last evaluation.
TEST(CheckpointResume, AnEvaluationTheResumedRunDoesNotRepeatIsKept) {
  TempDir tmp;
  train::run_training(tiny_config(
      tmp / "run", {"train.steps=4", "train.eval_every=4", "checkpoint.every_steps=4"}));
  train::run_training(
      tiny_config(tmp / "run", {"train.steps=6", "train.eval_every=5", "train.resume=auto"}));
  const std::string record = file_bytes(tmp / "run/metrics.jsonl");
  for (int step : {4, 5, 6}) {
    const std::string event = "\"event\":\"eval\",\"step\":" + std::to_string(step) + "}";
    const size_t first = record.find(event);
    EXPECT_NE(first, std::string::npos) << "no evaluation at step " << step << "\n" << record;
    EXPECT_EQ(record.find(event, first + 1), std::string::npos) << "twice at " << step;
  }
}

TEST(CheckpointResume, ACheckpointAtOrPastTheLastStep) {
  TempDir tmp;
  train::run_training(tiny_config(tmp / "run", {"train.steps=2", "checkpoint.every_steps=2"}));
  train::TrainSummary again =
      train::run_training(tiny_config(tmp / "run", {"train.steps=2", "train.resume=auto"}));
  EXPECT_EQ(again.first_step, 2);
  EXPECT_EQ(again.steps, 2) << "nothing left to train";
  try {
    train::run_training(tiny_config(tmp / "run", {"train.steps=1", "train.resume=auto"}));
    ADD_FAILURE() << "resumed at step 2 of a 1-step run";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("at step 2, past train.steps (1)"), std::string::npos)
        << e.what();
  }
}

namespace {

// The log of a run that resumes the 2-step run in `out_dir` for its third step under `overrides`;
// that step's checkpoint is removed again, so the next call resumes from step 2 as well.
std::string resumed_step_3_log(const std::string& out_dir,
                               const std::vector<std::string>& overrides) {
  std::vector<std::string> all = {"train.steps=3", "train.resume=auto", "train.progress=lines",
                                  "checkpoint.keep_last=0", "train.export=false"};
  all.insert(all.end(), overrides.begin(), overrides.end());
  ::testing::internal::CaptureStderr();
  train::run_training(tiny_config(out_dir, all));
  fs::remove(out_dir + "/checkpoints/" + io::checkpoint_file_name(3));
  return ::testing::internal::GetCapturedStderr();
}

}  // namespace

// A resumed run that takes another number of sequences per step (another rank count with
// global_batch 0, or changed batch keys) says so and how to keep the old batch; one whose
// held-out split moved says that its evaluation losses are no longer comparable.
TEST(CheckpointResume, AnotherBatchSizeOrHeldOutSplitThanTheCheckpointsIsNoted) {
  TempDir tmp;
  train::run_training(tiny_config(tmp / "run", {"train.steps=2", "checkpoint.every_steps=1"}));
  auto resume_log = [&](const std::vector<std::string>& overrides) {
    return resumed_step_3_log(tmp / "run", overrides);
  };
  std::string log = resume_log({"train.global_batch=8"});
  EXPECT_NE(log.find("note: the checkpoint's run took 4 sequences per step (1 rank(s)); this one "
                     "takes 8 (1 rank(s)), so the steps from here on see another batch size at "
                     "the same learning rates; set train.global_batch=4 to keep it"),
            std::string::npos)
      << log;
  log = resume_log({"train.global_batch=0", "train.micro_batch=3"});
  EXPECT_NE(log.find("this one takes 3 (1 rank(s)), so the steps from here on see another batch "
                     "size at the same learning rates; train.global_batch=4 would keep it but is "
                     "not a multiple of train.micro_batch x ranks = 3"),
            std::string::npos)
      << log;
  log = resume_log({"train.global_batch=0", "train.micro_batch=2", "train.global_batch_tokens=64"});
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  EXPECT_EQ(log.find("note: "), std::string::npos) << "64 tokens of 16 are the same 4 sequences\n"
                                                   << log;
  // Another held-out split.
  log = resume_log({"data.eval_fraction=0.1"});
  EXPECT_NE(log.find("note: data.eval_fraction was 0.05 for the checkpoint's run and is 0.1 now: "
                     "the held-out windows are no longer those the earlier steps never trained "
                     "on, so evaluation losses may read low; keep data.eval_fraction to compare "
                     "them with the run's earlier ones"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("sequences per step"), std::string::npos) << log;
}

// The export and adapter directories are checked at the start but written at the end: a run
// refused after the check leaves none behind (empty directories would pass for a failed export).
TEST(CheckpointResume, ARefusedRunLeavesNoEmptyExportDirectory) {
  TempDir tmp;
  expect_error<ConfigError>(
      [&] { train::run_training(tiny_config(tmp / "run/nested", {"model.vocab_size=100"})); },
      {"has vocabulary size 256 but model.vocab_size is 100"});
  // Nothing at all: the directories it created are gone (config.yaml is written once a run
  // goes ahead).
  EXPECT_FALSE(fs::exists(tmp / "run"));
  // Nor an empty checkpoint directory, the default one or one of its own with its run lock;
  // a directory that was there before stays.
  for (const std::string& dir : {std::string(), tmp / "ckpt/a", tmp / "run"}) {
    std::vector<std::string> overrides = {"model.vocab_size=100", "checkpoint.every_steps=1"};
    if (!dir.empty()) overrides.push_back("checkpoint.dir=" + dir);
    expect_error<ConfigError>([&] { train::run_training(tiny_config(tmp / "run", overrides)); },
                              {"model.vocab_size is 100"});
    EXPECT_FALSE(fs::exists(tmp / "run/checkpoints")) << dir;
    EXPECT_FALSE(fs::exists(tmp / "ckpt")) << dir;
    EXPECT_FALSE(fs::exists(tmp / "run")) << dir;
  }
  // A checkpoint.dir that cannot be created (a file in its path) refuses the run after
  // train.out_dir was made: that goes too.
  const std::string file = tmp.write("a-file", "x");
  expect_error<ConfigError>(
      [&] {
        train::run_training(tiny_config(tmp / "run/nested", {"checkpoint.dir=" + file + "/ck"}));
      },
      {"checkpoint.dir = '" + file + "/ck': cannot create the directory"});
  EXPECT_FALSE(fs::exists(tmp / "run"));
  expect_error<ConfigError>(
      [&] {
        train::run_training(tiny_config(tmp / "lora", {"model.vocab_size=100", "lora.enabled=true",
                                                       "lora.adapter_out=" + (tmp / "a/b/c")}));
      },
      {"model.vocab_size is 100"});
  EXPECT_FALSE(fs::exists(tmp / "a"));
}

// The resumed sampler continues the checkpoint's order over the data: a run that asks for another
// shuffle seed, or whose data.path now holds other tokens, says so; the same file under another
// name is no change.
TEST(CheckpointResume, ChangedDataOrShuffleSeedIsNoted) {
  TempDir tmp;
  auto write_text = [&](const std::string& line) {
    std::ofstream out(tmp / "data.txt");
    for (int i = 0; i < 200; ++i) out << line << i << "\n";
  };
  write_text("the first text, line ");
  const std::string data = "data.path=" + (tmp / "data.txt");
  train::run_training(
      tiny_config(tmp / "run", {"train.steps=2", "checkpoint.every_steps=1", data}));
  auto resume_log = [&](const std::vector<std::string>& overrides) {
    return resumed_step_3_log(tmp / "run", overrides);
  };
  std::string log = resume_log({"data.path=" + tmp.str() + "/./data.txt"});
  EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
  EXPECT_EQ(log.find("note: "), std::string::npos) << "the same file, the same seed\n" << log;
  log = resume_log({data, "data.seed=99"});
  EXPECT_NE(log.find("note: data.seed is 99 but the checkpoint's run shuffled with 1234; the "
                     "resumed run keeps that order"),
            std::string::npos)
      << log;
  write_text("a second text, row ");
  log = resume_log({data});
  EXPECT_NE(log.find("note: the tokens in data.path '" + (tmp / "data.txt") +
                     "' differ from those the checkpoint's run trained on; the steps from here "
                     "on read the new tokens"),
            std::string::npos)
      << log;
  // Data with fewer training windows than the checkpoint's run had taken of its epoch (8, two
  // steps of 4): there is no window to continue at, so the next epoch begins.
  std::ofstream(tmp / "data.txt") << std::string(120, 'x');
  log = resume_log({data, "data.eval_fraction=0.2"});
  EXPECT_NE(log.find("note: the checkpoint's run had taken 8 windows of epoch 0, more than the "),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("continuing at the start of epoch 1"), std::string::npos) << log;
}

// A fresh run does not train over an earlier run's checkpoints (it would replace some, keep the
// others, and a later resume=auto would continue the wrong run); a resume path that names a
// rank file, or a directory without checkpoints, is an error that says what to give instead.
TEST(CheckpointResume, FreshRunsOverCheckpointsAndWrongResumePathsAreRefused) {
  TempDir tmp;
  train::run_training(tiny_config(
      tmp / "run", {"train.steps=4", "checkpoint.every_steps=2", "optim.warmup_steps=1"}));
  const std::string dir = tmp / "run/checkpoints";
  auto error_of = [&](const std::vector<std::string>& overrides) -> std::string {
    try {
      train::run_training(tiny_config(tmp / "run", overrides));
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  std::string message = error_of({"train.steps=6", "checkpoint.every_steps=2"});
  EXPECT_NE(message.find("the checkpoint directory '" + dir +
                         "' holds checkpoints of an earlier run (the newest at step 4) and "
                         "train.resume is none: continue that run with train.resume=auto"),
            std::string::npos)
      << message;
  EXPECT_EQ(step_losses(tmp / "run/metrics.jsonl").size(), 4u) << "the old run's metrics were lost";

  const std::string rank_file = dir + "/" + io::rank_file_name(4, 0);
  message = error_of({"train.steps=6", "train.resume=" + rank_file});
  EXPECT_NE(message.find("is one rank's file of checkpoint step 4; resume from its main "
                         "file, " +
                         dir + "/step-00000004.h5"),
            std::string::npos)
      << message;

  fs::create_directories(tmp / "empty");
  message = error_of({"train.steps=6", "train.resume=" + (tmp / "empty")});
  EXPECT_NE(message.find("train.resume='" + (tmp / "empty") +
                         "': no complete checkpoint in that directory; name another, or use "
                         "train.resume=auto"),
            std::string::npos)
      << message;

  // Resuming with more steps stretches the schedule: the log says how the rate moves.
  ::testing::internal::CaptureStderr();
  train::run_training(tiny_config(tmp / "run", {"train.steps=10", "train.resume=auto",
                                                "train.progress=lines", "optim.warmup_steps=1"}));
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("note: the learning-rate schedule differs from the checkpoint's run "
                     "(train.steps 4 -> 10): step 5 runs at "),
            std::string::npos)
      << log;
}

// Two runs in one directory: the second is refused while the first holds it.
TEST(CheckpointDirectory, ASecondRunInTheSameDirectoryIsRefused) {
  TempDir tmp;
  train::Config config = tiny_config(tmp / "run", {"train.progress=lines", "train.steps=100000"});
  const pid_t child = spawn_started_child(config, tmp.path.string(), tmp / "child.log");
  ASSERT_GT(child, 0) << file_bytes(tmp / "child.log");
  std::string message = "no error";
  try {
    train::run_training(tiny_config(tmp / "run", {"train.steps=2"}));
  } catch (const ConfigError& e) {
    message = e.what();
  }
  // Its default checkpoint directory is locked too: another run may not save there.
  std::string checkpoint_message = "no error";
  try {
    train::run_training(tiny_config(
        tmp / "other", {"train.steps=2", "checkpoint.dir=" + (tmp / "run/checkpoints")}));
  } catch (const ConfigError& e) {
    checkpoint_message = e.what();
  }
  kill(child, SIGKILL);
  wait_child(child);
  EXPECT_NE(message.find("train.out_dir = '" + (tmp / "run") + "' is in use by another run (pid " +
                         std::to_string(child) + " holds"),
            std::string::npos)
      << message;
  EXPECT_NE(checkpoint_message.find("checkpoint.dir = '" + (tmp / "run/checkpoints") +
                                    "' is in use by another run (pid " + std::to_string(child) +
                                    " holds"),
            std::string::npos)
      << checkpoint_message;
  // The lock goes with the process that held it: a killed run leaves nothing to clean up.
  EXPECT_NO_THROW(train::run_training(tiny_config(tmp / "run", {"train.steps=2"})));
}

// Two runs started at once on a new directory both create it; the one refused by the lock must not
// take back the directory (and the lock file) of the one that won.
TEST(CheckpointDirectory, ARunTakesBackOnlyDirectoriesItHolds) {
  TempDir tmp;
  const std::string dir = tmp / "new/run";
  std::optional<train::RunLock> winner;
  {
    train::DirectoriesOfThisRun loser;
    loser.prepare(dir, "train.out_dir");
    winner.emplace(dir, "train.out_dir");
    EXPECT_THROW(train::RunLock(dir, "train.out_dir"), ConfigError);
  }
  EXPECT_TRUE(fs::exists(fs::path(dir) / train::RunLock::kFileName));
  // Once it holds the lock, a run takes back what it created and left empty, innermost first
  // however the paths are spelled (an absolute one around a relative one).
  winner.reset();
  fs::remove_all(tmp / "new");
  const fs::path cwd = fs::current_path();
  fs::current_path(tmp.path);
  {
    train::DirectoriesOfThisRun run;
    run.prepare(tmp / "new/run", "train.out_dir");
    run.prepare("new/run/checkpoints", "checkpoint.dir");
    train::RunLock out(tmp / "new/run", "train.out_dir");
    train::RunLock checkpoints("new/run/checkpoints", "checkpoint.dir");
    run.take_back_at_end();
  }
  fs::current_path(cwd);
  EXPECT_FALSE(fs::exists(tmp / "new"));
}

// Rolling a run back to an earlier checkpoint of its directory while later ones remain would mix
// two runs: pruning keeps the later ones over the new saves, and resume=auto continues them.
TEST(CheckpointResume, RollingBackWhileLaterCheckpointsRemainIsRefused) {
  TempDir tmp;
  train::run_training(tiny_config(tmp / "run", {"train.steps=4", "checkpoint.every_steps=2"}));
  const std::string earlier = tmp / "run/checkpoints/step-00000002.h5";
  expect_error<ConfigError>(
      [&] {
        train::run_training(tiny_config(
            tmp / "run", {"train.steps=4", "checkpoint.every_steps=1", "train.resume=" + earlier}));
      },
      {"train.resume: resuming step 2 from '" + earlier + "', but the checkpoint directory '" +
           (tmp / "run/checkpoints") + "' also holds later checkpoints (step-00000004.h5)",
       "give this run another checkpoint.dir"});
  // Another checkpoint.dir for the rolled-back run is the way.
  train::TrainSummary s = train::run_training(tiny_config(
      tmp / "run", {"train.steps=4", "checkpoint.every_steps=1",
                    "checkpoint.dir=" + (tmp / "rolled-back"), "train.resume=" + earlier}));
  EXPECT_EQ(s.first_step, 2);
  EXPECT_EQ(s.last_checkpoint, tmp / "rolled-back/step-00000004.h5");
}

// With model.from_hf the model is config.json's: resuming on a config.json that changed between
// the runs (another rope_theta, with every tensor's shape the same) is refused.
TEST(CheckpointResume, ResumingOnAnotherConfigJsonIsRefused) {
  TempDir tmp;
  train::run_training(tiny_config(tmp / "base", {"train.steps=1", "train.export=true"}));
  fs::copy(tmp / "base/export", tmp / "same");
  fs::copy(tmp / "base/export", tmp / "other");
  nlohmann::json config_json = nlohmann::json::parse(std::ifstream(tmp / "other/config.json"));
  config_json["rope_theta"] = 500000.0;
  std::ofstream(tmp / "other/config.json") << config_json.dump(2);
  train::run_training(tiny_config(tmp / "run", {"train.steps=2", "checkpoint.every_steps=2",
                                                "model.from_hf=" + (tmp / "base/export")}));
  expect_error<ConfigError>(
      [&] {
        train::run_training(tiny_config(tmp / "run", {"train.steps=3", "train.resume=auto",
                                                      "model.from_hf=" + (tmp / "other")}));
      },
      {"was saved for another model (rope_theta: checkpoint 10000.0, this run 500000.0)",
       "this run's model comes from " + (tmp / "other") + "/config.json"});
  // A copy of the same config.json is the same model.
  train::TrainSummary s = train::run_training(tiny_config(
      tmp / "run", {"train.steps=3", "train.resume=auto", "model.from_hf=" + (tmp / "same")}));
  EXPECT_EQ(s.first_step, 2);
}

TEST(CheckpointResume, ResumeAutoWithoutCheckpointsStartsFromScratch) {
  TempDir tmp;
  // Files that only look like checkpoints (a step past int64, of a main file, a rank file and a
  // temporary) are not this program's: they are passed over, not an error.
  fs::create_directories(tmp / "run/checkpoints");
  for (const char* name : {"step-99999999999999999999999.h5", "step-99999999999999999999.rank-0.h5",
                           "step-99999999999999999999.h5.tmp"})
    std::ofstream(tmp / "run/checkpoints" + "/" + name) << "not a checkpoint";
  EXPECT_TRUE(io::list_checkpoints(tmp / "run/checkpoints").empty());
  train::TrainSummary s =
      train::run_training(tiny_config(tmp / "run", {"train.steps=2", "train.resume=auto"}));
  EXPECT_EQ(step_losses(s.metrics_path).size(), 2u);
}

// An output or checkpoint directory that cannot be made is a config error naming its key, raised
// before any training step (not at the first save, after the steps before it).
TEST(CheckpointDirectory, AnUnusableDirectoryIsAConfigErrorBeforeTraining) {
  TempDir tmp;
  const std::string file = tmp / "a-file";
  std::ofstream(file) << "x";
  auto error_of = [&](const train::Config& config) -> std::string {
    try {
      train::run_training(config);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  std::string message = error_of(tiny_config(file, {"train.steps=2"}));
  EXPECT_NE(message.find("train.out_dir = '" + file + "'"), std::string::npos) << message;
  // Without periodic saves too: a stop signal saves whatever checkpoint.every_* say.
  message = error_of(tiny_config(tmp / "run", {"train.steps=2", "checkpoint.dir=" + file + "/c"}));
  EXPECT_NE(message.find("checkpoint.dir = '" + file + "/c'"), std::string::npos) << message;
  EXPECT_FALSE(fs::exists(tmp / "run/metrics.jsonl")) << "training started";
  fs::create_directories(tmp / "run");
  std::ofstream(tmp / "run/checkpoints") << "x";
  message = error_of(tiny_config(tmp / "run", {"train.steps=2"}));
  EXPECT_NE(message.find("checkpoint.dir (default: under train.out_dir) = '" +
                         (tmp / "run/checkpoints") + "': cannot create the directory"),
            std::string::npos)
      << message;
  fs::remove(tmp / "run/checkpoints");
  // The adapter and the export are written after the last step, and checked before the first.
  message =
      error_of(tiny_config(tmp / "run", {"train.steps=2", "lora.enabled=true",
                                         "lora.quantize_base=none", "lora.adapter_out=" + file}));
  EXPECT_NE(message.find("lora.adapter_out = '" + file + "': cannot create the directory"),
            std::string::npos)
      << message;
  EXPECT_FALSE(fs::exists(tmp / "run/metrics.jsonl")) << "training started";
  fs::create_directories(tmp / "run");
  std::ofstream(tmp / "run/export") << "x";
  message = error_of(tiny_config(tmp / "run", {"train.steps=2", "train.export=true"}));
  EXPECT_NE(message.find("train.export (to <train.out_dir>/export) = '" + (tmp / "run/export") +
                         "': cannot create the directory"),
            std::string::npos)
      << message;
  EXPECT_FALSE(fs::exists(tmp / "run/metrics.jsonl")) << "training started";
}

TEST(CheckpointRetention, KeepLastDeletesOlderCheckpointsAndTheirRankFiles) {
  TempDir tmp;
  train::run_training(tiny_config(
      tmp / "run", {"train.steps=10", "checkpoint.every_steps=2", "checkpoint.keep_last=2"}));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(tmp / "run/checkpoints"))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  // The run's lock stays with the checkpoints (and is released with the run).
  EXPECT_EQ(names, (std::vector<std::string>{".shardtrain.lock", "step-00000008.h5",
                                             "step-00000008.rank-0.h5", "step-00000010.h5",
                                             "step-00000010.rank-0.h5"}));
}

// A later checkpoint that resume refused (here: a rank file lost) is not one keep_last keeps:
// the checkpoints the resumed run writes are, and the one it resumed from goes only once they
// replace it. The refused one stays until the run's own checkpoints pass it.
TEST(CheckpointRetention, ARefusedLaterCheckpointDoesNotTakeTheSlotOfTheRunsOwn) {
  TempDir tmp;
  const std::string dir = tmp / "run/checkpoints";
  auto names = [&] {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename() != ".shardtrain.lock") out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  };
  train::run_training(tiny_config(
      tmp / "run", {"train.steps=8", "checkpoint.every_steps=4", "checkpoint.keep_last=0"}));
  fs::remove(dir + "/step-00000008.rank-0.h5");
  train::TrainSummary s = train::run_training(
      tiny_config(tmp / "run", {"train.steps=7", "train.resume=auto", "checkpoint.every_steps=3",
                                "checkpoint.keep_last=1"}));
  EXPECT_EQ(s.first_step, 4);
  EXPECT_EQ(names(), (std::vector<std::string>{"step-00000007.h5", "step-00000007.rank-0.h5",
                                               "step-00000008.h5"}));
  // The next resume refuses step 8 again and takes the run's own step 7; once the run writes
  // step 8 itself and goes past it, the damaged files are gone.
  s = train::run_training(
      tiny_config(tmp / "run", {"train.steps=10", "train.resume=auto", "checkpoint.every_steps=1",
                                "checkpoint.keep_last=2"}));
  EXPECT_EQ(s.first_step, 7);
  EXPECT_EQ(names(), (std::vector<std::string>{"step-00000009.h5", "step-00000009.rank-0.h5",
                                               "step-00000010.h5", "step-00000010.rank-0.h5"}));
}

// ---- signals and crashes ----------------------------------------------------------------------

// SIGTERM (schedulers), SIGINT (Ctrl-C) once, and SIGHUP (the terminal went away).
class CheckpointSignals : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointSignals, ASignalSavesAtTheEndOfTheStepExitsZeroAndResumesBitwise) {
  const int signal = GetParam();
  const std::string name = signal == SIGTERM ? "SIGTERM" : signal == SIGINT ? "SIGINT" : "SIGHUP";
  TempDir tmp;
  train::TrainSummary ref = train::run_training(tiny_config(tmp / "ref"));
  std::map<int64_t, double> ref_losses = step_losses(ref.metrics_path);

  train::Config config = tiny_config(tmp / "run", {"train.progress=lines"});
  const std::string log_path = tmp / "child.log";
  // Its 40 steps take a fraction of a second: on a loaded machine the run may end before the
  // signal is sent (nothing tested then), so it is tried again.
  int code = -1;
  std::string log;
  for (int attempt = 0; attempt < 5; ++attempt) {
    fs::remove_all(tmp / "run");
    const pid_t child = spawn_started_child(config, tmp.path.string(), log_path);
    ASSERT_GT(child, 0) << file_bytes(log_path);
    kill(child, signal);
    code = wait_child(child);
    log = file_bytes(log_path);
    if (log.find("child finished: 40 steps, stopped_early 0") == std::string::npos) break;
  }
  EXPECT_EQ(code, 0) << log;
  std::smatch m;
  ASSERT_TRUE(
      std::regex_search(log, m, std::regex("received " + name + R"(: stopped after step (\d+))")))
      << log;
  const int64_t stopped = std::stoll(m[1].str());
  EXPECT_GE(stopped, 1);
  EXPECT_LT(stopped, 40) << "the run ended before the signal arrived; nothing was tested";
  const std::string saved = tmp / ("run/checkpoints/" + io::checkpoint_file_name(stopped));
  EXPECT_NE(log.find("child finished: " + std::to_string(stopped) + " steps, stopped_early 1"),
            std::string::npos)
      << log;
  dist::LocalProcessGroup local;
  EXPECT_EQ(io::verify_checkpoint(local, saved), "");

  // Resuming in the same run directory continues the metrics and the exact run.
  config.train.resume = "auto";
  config.train.progress = "none";
  train::TrainSummary resumed = train::run_training(config);
  EXPECT_EQ(step_losses(resumed.metrics_path), ref_losses);
  EXPECT_TRUE(file_bytes(resumed.export_dir + "/model.safetensors") ==
              file_bytes(ref.export_dir + "/model.safetensors"))
      << "the exported weights differ from the uninterrupted run's";
}

INSTANTIATE_TEST_SUITE_P(TermIntAndHup, CheckpointSignals,
                         ::testing::Values(SIGTERM, SIGINT, SIGHUP), [](const auto& info) {
                           return std::string(info.param == SIGTERM  ? "sigterm"
                                              : info.param == SIGINT ? "sigint"
                                                                     : "sighup");
                         });

// SIGHUP asks for a stop, unless it was ignored before (nohup): then it stays ignored.
// The CLI installs handlers before a run starts; the trainer's own, nested, keep a stop that
// arrived meanwhile. The outermost clears an earlier run's request.
TEST(CheckpointSignalHandlers, NestedHandlersKeepAPendingStop) {
  {
    train::StopSignalHandlers outer;
    train::request_stop(SIGUSR1);
    train::StopSignalHandlers inner;
    EXPECT_EQ(train::stop_signal(), SIGUSR1);
  }
  train::StopSignalHandlers fresh;
  EXPECT_EQ(train::stop_signal(), 0);
}

// fp16 with loss scaling skips a step whose gradients overflow; a loss that is itself nan (the
// forward overflows: weights of scale 1e4) is not fixed by any scale, and the run stops on the
// third such step instead of skipping every step to the end.
TEST(CheckpointResume, AForwardThatOverflowsStopsTheRun) {
  TempDir tmp;
  try {
    train::run_training(tiny_config(
        tmp / "run", {"train.steps=6", "precision.compute=fp16", "model.init_std=10000"}));
    ADD_FAILURE() << "trained on with a nan loss";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("for 3 steps in a row"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("loss scaling cannot fix"), std::string::npos) << e.what();
  }
}

TEST(CheckpointSignalHandlers, HangupStopsUnlessIgnoredAsUnderNohup) {
  struct sigaction before {};
  sigaction(SIGHUP, nullptr, &before);
  ::signal(SIGHUP, SIG_DFL);  // this test may itself run under nohup
  {
    train::StopSignalHandlers handlers;
    ::raise(SIGHUP);
    EXPECT_EQ(train::stop_signal(), SIGHUP);
  }
  ::signal(SIGHUP, SIG_IGN);
  {
    train::StopSignalHandlers handlers;
    ::raise(SIGHUP);
    EXPECT_EQ(train::stop_signal(), 0) << "nohup's choice was overridden";
    struct sigaction now {};
    sigaction(SIGHUP, nullptr, &now);
    EXPECT_EQ(now.sa_handler, SIG_IGN);
  }
  struct sigaction after {};
  sigaction(SIGHUP, nullptr, &after);
  EXPECT_EQ(after.sa_handler, SIG_IGN) << "the handlers did not restore the disposition";
  sigaction(SIGHUP, &before, nullptr);
  train::clear_stop_request();
}

// The CLI's output piped into a reader that leaves early (`| head`, or a `| tee` that Ctrl-C
// ended): the run does not die of SIGPIPE, nor of a failed write, and trains to its end.
TEST(CheckpointSignalHandlers, AClosedOutputPipeDoesNotEndTheRun) {
  TempDir tmp;
  const std::string config = tmp / "run.yaml";
  std::ofstream(config) << shardtrain::testing::kTinyRunYaml;
  const std::string command =
      "bash -c 'set -o pipefail; \"" + std::string(SHARDTRAIN_BINARY) + "\" train --config " +
      config + " --set train.out_dir=" + (tmp / "run") +
      " --set train.progress=lines --set train.log_every=1 2>&1 | head -n 1 >/dev/null; "
      "echo \"exit status ${PIPESTATUS[0]}\"'";
  EXPECT_EQ(run_command(command), "exit status 0\n");
  EXPECT_EQ(step_losses(tmp / "run/metrics.jsonl").size(), 40u) << "the run stopped early";
}

// A stop signal during an evaluation (here 40,000 held-out sequences, seconds of work) abandons
// it at the next batch rather than at its end: the step before it is saved and a resumed run
// carries on. Both evaluations of a run: one inside the loop (train.eval_every) and the final one
// after the last step, which saves that step and leaves the evaluation and export to the resume.
class EvaluationSignals : public ::testing::TestWithParam<bool> {};

TEST_P(EvaluationSignals, ASignalAbandonsTheEvaluationAndSavesTheStepBeforeIt) {
  const bool final_evaluation = GetParam();
  TempDir tmp;
  const int64_t steps = final_evaluation ? 2 : 3;
  train::Config config = tiny_config(
      tmp / "run",
      {"train.progress=lines", "train.steps=" + std::to_string(steps), "data.eval_fraction=0.5",
       // Eight layers: the whole evaluation takes about 20 s here, far past the 2 s after which
       // it says it is under way, on a machine several times faster too.
       "train.eval_batches=10000", "model.num_layers=8",
       final_evaluation ? "train.eval_every=" + std::to_string(steps) : "train.eval_every=1"});
  const std::string log_path = tmp / "child.log";
  pid_t child = spawn_training_child(config, tmp.path.string(), log_path);
  ASSERT_GT(child, 0);
  // An evaluation still running after Progress::kEvalLineAfter says so (progress=lines): then it
  // is under way, past the step's end-of-step checks (which would take the signal themselves),
  // with most of its 40,000 sequences to go.
  const std::string metrics = tmp / "run/metrics.jsonl";
  const int64_t evaluated = final_evaluation ? steps : 1;
  ASSERT_TRUE(wait_until([&] {
    return file_bytes(log_path).find("evaluating step " + std::to_string(evaluated) + ": ") !=
           std::string::npos;
  })) << file_bytes(log_path);
  const auto sent = std::chrono::steady_clock::now();
  kill(child, SIGTERM);
  const int code = wait_child(child);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - sent).count();
  const std::string log = file_bytes(log_path);
  EXPECT_EQ(code, 0) << log;
  const std::string step = std::to_string(evaluated);
  EXPECT_NE(log.find("the evaluation at step " + step + " was abandoned: a stop was requested"),
            std::string::npos)
      << "the evaluation ran to its end before the stop (" << seconds << " s)\n"
      << log;
  EXPECT_EQ(log.find("eval step " + step + ":"), std::string::npos) << log;
  EXPECT_NE(log.find("received SIGTERM: stopped after step " + step + " with checkpoint"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("child finished: " + step + " steps, stopped_early 1"), std::string::npos)
      << log;
  EXPECT_EQ(log.find("exported the model"), std::string::npos) << log;
  dist::LocalProcessGroup local;
  EXPECT_EQ(io::verify_checkpoint(local,
                                  tmp / ("run/checkpoints/" + io::checkpoint_file_name(evaluated))),
            "");
  EXPECT_EQ(io::list_checkpoints(tmp / "run/checkpoints").size(), 1u) << "saved once";

  // The resumed run evaluates that step in full and finishes (final: nothing left to train). A
  // smaller evaluation set (not a setting of the weights) keeps it short on an emulated GPU.
  config.train.resume = "auto";
  config.train.eval_batches = 4;
  config.train.progress = "none";
  train::TrainSummary resumed = train::run_training(config);
  EXPECT_EQ(resumed.first_step, evaluated);
  EXPECT_EQ(resumed.steps, steps);
  EXPECT_FALSE(resumed.stopped_early);
  EXPECT_GT(resumed.final_eval_loss, 0);
  EXPECT_TRUE(fs::exists(resumed.export_dir + "/model.safetensors"));
  // The abandoned evaluation is in the record once, made by the resumed run; the final one too.
  const std::string record = file_bytes(metrics);
  auto evaluations_at = [&](int64_t s) {
    const std::string event = "\"event\":\"eval\",\"step\":" + std::to_string(s) + "}";
    int n = 0;
    for (size_t at = record.find(event); at != std::string::npos; at = record.find(event, at + 1))
      ++n;
    return n;
  };
  EXPECT_EQ(evaluations_at(evaluated), 1) << record;
  EXPECT_EQ(evaluations_at(steps), 1) << record;
}

INSTANTIATE_TEST_SUITE_P(LoopAndFinal, EvaluationSignals, ::testing::Values(false, true),
                         [](const auto& info) {
                           return std::string(info.param ? "final" : "in_the_loop");
                         });

// An evaluation set larger than the held-out split would count windows twice.
TEST(CheckpointEvaluation, MoreEvaluationBatchesThanTheSplitHoldsIsAConfigError) {
  TempDir tmp;
  // 0.1 % of the built-in corpus's 1,310,720 tokens: 1,311 tokens, 81 windows of 16 + 1 tokens,
  // 20 micro-batches of 4.
  try {
    train::run_training(tiny_config(
        tmp / "run", {"data.eval_fraction=0.001", "train.eval_every=1", "train.eval_batches=21"}));
    ADD_FAILURE() << "an evaluation set past the split was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "train.eval_batches x train.micro_batch = 21 x 4 = 84 held-out sequences, but "
                  "the evaluation split of builtin corpus (data.eval_fraction 0.001) holds 81 of "
                  "train.seq_len 16: lower train.eval_batches to 20 or less, or raise "
                  "data.eval_fraction"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(tmp / "run/metrics.jsonl")) << "the error came after training began";
  train::TrainSummary s = train::run_training(
      tiny_config(tmp / "run", {"data.eval_fraction=0.001", "train.steps=1", "train.eval_every=1",
                                "train.eval_batches=20"}));
  EXPECT_GT(s.final_eval_loss, 0);
}

TEST(CheckpointCrash, AFullDiskFailsTheSaveWithTheSystemsMessageAndNoCrash) {
  // Every file write past 64 KiB fails, as on a full disk: the first checkpoint's (a few hundred
  // KiB) does. HDF5 cannot close a file whose write failed; the process must still end with the
  // error (the gtest failure of the child: exit 1), not crash in the library's exit clean-up.
  TempDir tmp;
  train::Config config = tiny_config(tmp / "run", {"checkpoint.every_steps=1", "train.steps=3"});
  pid_t child = spawn_training_child(config, tmp.path.string(), tmp / "child.log", 64 << 10);
  ASSERT_GT(child, 0);
  const int code = wait_child(child);
  const std::string log = file_bytes(tmp / "child.log");
  EXPECT_EQ(code, 1) << log;
  EXPECT_NE(log.find("saving checkpoint step 1 failed"), std::string::npos) << log;
  EXPECT_NE(log.find("(File too large)"), std::string::npos) << log;
  EXPECT_TRUE(io::list_checkpoints(tmp / "run/checkpoints").empty());
}

// The run's record must not be lost quietly: a config.yaml or metrics.jsonl that cannot be
// written (a full disk, as a file-size limit makes it; a directory in the way) ends the run with
// the file and the system's message.
TEST(CheckpointCrash, AMetricsOrConfigFileThatCannotBeWrittenEndsTheRun) {
  TempDir tmp;
  train::Config config = tiny_config(tmp / "run", {"train.export=false"});
  const int64_t config_bytes = static_cast<int64_t>(config.to_yaml().size());
  struct Case {
    rlim_t limit;
    std::string file;
  };
  // The config first (half of it fits), then metrics.jsonl (the config and a few steps fit).
  for (const Case& c : {Case{static_cast<rlim_t>(config_bytes / 2), "config.yaml"},
                        Case{static_cast<rlim_t>(config_bytes + 2000), "metrics.jsonl"}}) {
    SCOPED_TRACE(c.file);
    fs::remove_all(tmp / "run");
    pid_t child = spawn_training_child(config, tmp.path.string(), tmp / "child.log", c.limit);
    ASSERT_GT(child, 0);
    const int code = wait_child(child);
    const std::string log = file_bytes(tmp / "child.log");
    EXPECT_EQ(code, 1) << log;
    EXPECT_NE(log.find("cannot write " + (tmp / ("run/" + c.file)) + " (File too large)"),
              std::string::npos)
        << log;
    EXPECT_EQ(log.find("child finished"), std::string::npos) << log;
  }
  // metrics.jsonl is a directory.
  fs::remove_all(tmp / "run");
  fs::create_directories(tmp / "run/metrics.jsonl");
  try {
    train::run_training(config);
    ADD_FAILURE() << "trained without a metrics file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write " + (tmp / "run/metrics.jsonl")),
              std::string::npos)
        << e.what();
  }
}

TEST(CheckpointCrash, ASaveKilledPartWayLeavesThePreviousCheckpointIntactAndChosen) {
  // Big enough that a save takes a while (~40 MB per checkpoint).
  const std::vector<std::string> bigger = {"model.hidden_size=256", "model.intermediate_size=688",
                                           "model.num_layers=4",    "train.micro_batch=1",
                                           "train.steps=1000",      "checkpoint.every_steps=1",
                                           "checkpoint.keep_last=2"};
  for (int attempt = 0; attempt < 3; ++attempt) {
    TempDir tmp;
    const std::string dir = tmp / "run/checkpoints";
    train::Config config = tiny_config(tmp / "run", bigger);
    pid_t child = spawn_training_child(config, tmp.path.string(), tmp / "child.log");
    ASSERT_GT(child, 0);
    // Kill it while it writes a checkpoint after at least one complete one.
    static const std::regex tmp_name(R"(step-(\d+)(\.rank-\d+)?\.h5\.tmp)");
    int64_t interrupted = -1;
    bool seen = wait_until([&] {
      std::vector<io::CheckpointEntry> done = io::list_checkpoints(dir);
      if (done.empty()) return false;
      std::error_code ec;
      for (const auto& e : fs::directory_iterator(dir, ec)) {
        std::smatch m;
        std::string name = e.path().filename().string();
        if (std::regex_match(name, m, tmp_name) && std::stoll(m[1].str()) > done.front().step) {
          interrupted = std::stoll(m[1].str());
          return true;
        }
      }
      return false;
    });
    kill(child, SIGKILL);
    EXPECT_EQ(wait_child(child), 128 + SIGKILL);
    ASSERT_TRUE(seen) << file_bytes(tmp / "child.log");
    bool left_temporary = false;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".tmp") left_temporary = true;
    if (!left_temporary) continue;  // the save finished before the kill landed: try again

    std::vector<io::CheckpointEntry> entries = io::list_checkpoints(dir);
    ASSERT_FALSE(entries.empty());
    EXPECT_EQ(entries.front().step, interrupted - 1);
    dist::LocalProcessGroup local;
    EXPECT_EQ(io::verify_checkpoint(local, entries.front().path), "");

    // resume=auto picks it and trains on from it.
    config.train.resume = "auto";
    config.train.steps = interrupted;
    config.checkpoint.every_steps = 0;
    config.train.export_model = false;
    config.train.progress = "lines";
    ::testing::internal::CaptureStderr();
    train::TrainSummary resumed = train::run_training(config);
    std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("resumed from " + entries.front().path), std::string::npos) << log;
    EXPECT_TRUE(std::isfinite(resumed.final_loss));
    return;
  }
  FAIL() << "three saves finished before SIGKILL landed; the window was never hit";
}

// A resumed run keeps the metrics records up to its checkpoint's step. Lines it cannot place (not
// JSON, or a step or event of the wrong type or out of range, as an edit or another program may
// leave) are dropped, not fatal, and never kept past the checkpoint.
TEST(CheckpointMetrics, ResumingDropsRecordsThatAreDamagedOrPastTheCheckpoint) {
  TempDir tmp;
  const std::string path = tmp / "metrics.jsonl";
  {
    std::ofstream out(path);
    out << R"({"event":"step","step":1,"loss":5.0})"
        << "\n"
        << "not json\n"
        << R"({"event":"step","step":"2","loss":4.0})"
        << "\n"
        << R"({"event":"step","step":null})"
        << "\n"
        << R"({"event":"eval","step":"2"})"
        << "\n"
        << R"({"event":7,"step":2})"
        << "\n"
        << R"({"step":2})"
        << "\n"
        << R"({"event":"step","step":18446744073709551615})"
        << "\n"
        << R"({"event":"step","step":1e300})"
        << "\n"
        << R"({"event":"step","step":-1})"
        << "\n"
        << R"({"event":"step","step":2,"loss":3.0})"
        << "\n"
        << R"({"event":"eval","step":2,"eval_loss":3.5})"
        << "\n"
        << R"({"event":"step","step":3,"loss":2.0})"
        << "\n";
  }
  std::ofstream metrics;
  ASSERT_NO_THROW(train::open_metrics(metrics, path, /*resumed_step=*/2,
                                      /*reevaluates_resumed_step=*/false));
  metrics << R"({"event":"step","step":3,"loss":2.5})"
          << "\n";
  metrics.close();
  EXPECT_EQ(file_bytes(path), R"({"event":"step","step":1,"loss":5.0})"
                              "\n"
                              R"({"event":"step","step":2,"loss":3.0})"
                              "\n"
                              R"({"event":"eval","step":2,"eval_loss":3.5})"
                              "\n"
                              R"({"event":"step","step":3,"loss":2.5})"
                              "\n");
}
