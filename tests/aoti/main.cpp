// Runs an AOTInductor package that calls torch.ops.rotary (made by
// make_package.py) and compares it with the eager output saved by Python.
// It includes no rotary header and calls no rotary function: linking
// rotary::rotary alone must keep librotary loaded so that the package finds
// the op schemas. CMakeLists.txt links with --as-needed to prove it.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::map<std::string, torch::Tensor> read_tensors(const std::string& dir) {
  std::map<std::string, torch::Tensor> out;
  std::ifstream index(dir + "/tensors.txt");
  std::string line;
  while (std::getline(index, line)) {
    std::istringstream fields(line);
    std::string name, dtype;
    fields >> name >> dtype;
    std::vector<int64_t> sizes;
    for (int64_t n; fields >> n;) sizes.push_back(n);
    const auto type = dtype == "float32" ? torch::kFloat32 : torch::kInt64;
    auto t = torch::empty(sizes, type);
    std::ifstream data(dir + "/" + name + ".bin", std::ios::binary);
    data.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    TORCH_CHECK(data.gcount() == static_cast<std::streamsize>(t.nbytes()), "short read of ", name);
    out[name] = t;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR (made by make_package.py)\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  auto t = read_tensors(dir);
  torch::NoGradGuard no_grad;
  torch::inductor::AOTIModelPackageLoader loader(dir + "/block.pt2");
  const auto outputs = loader.run({t.at("x"), t.at("position_ids")});
  const auto& expected = t.at("expected");
  const double max_diff = (outputs.at(0) - expected).abs().max().item<double>();
  const double scale = expected.abs().max().item<double>();
  const bool ok = outputs.size() == 1 && outputs[0].sizes() == expected.sizes() && max_diff <= 1e-5 * (1.0 + scale);
  std::printf("aoti_consumer: %zu output(s), max |AOTI - eager| = %.3g (max |eager| = %.3g): %s\n", outputs.size(),
              max_diff, scale, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
