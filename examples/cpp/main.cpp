// A C++ trainer's view of packcuda: the framework-free core API on raw pointers, and the registered torch
// ops called through the dispatcher (torch's stable C API), with results checked against plain loops.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include <packcuda/mrope.h>
#include <packcuda/pack.h>
#include <packcuda/packcuda_torch.h>
#include <packcuda/shard.h>

namespace {
int failures = 0;
void check(bool ok, const char* what) {
  std::printf("  [%s] %s\n", ok ? "ok" : "FAIL", what);
  failures += !ok;
}
}  // namespace

int main() {
  std::printf("packcuda C++ example (op library version %lld)\n",
              static_cast<long long>(packcuda::torch_library_version()));

  // A packed batch of four sequences (one empty).
  const std::vector<int64_t> lens = {5, 0, 7, 3};
  std::vector<int64_t> cu = {0};
  for (int64_t n : lens) cu.push_back(cu.back() + n);
  const int64_t nseg = static_cast<int64_t>(lens.size()), total = cu.back();

  // 1. core API: positions restart in every sequence
  std::vector<int64_t> pos(total);
  packcuda::pack::segment_positions_cpu(pos.data(), cu.data(), nseg, total);
  bool ok = true;
  for (int64_t s = 0; s < nseg; ++s)
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) ok &= pos[t] == t - cu[s];
  check(ok, "core: segment_positions_cpu");

  // 2. the same through the torch dispatcher: packcuda::segment_positions(Tensor cu_seqlens, int total, Device?)
  std::vector<int64_t> shape = {static_cast<int64_t>(cu.size())};
  torch::stable::Tensor cu_t = torch::stable::empty(shape, torch::headeronly::ScalarType::Long);
  std::memcpy(cu_t.mutable_data_ptr(), cu.data(), cu.size() * sizeof(int64_t));
  std::array<StableIValue, 3> stack{torch::stable::detail::from(cu_t), torch::stable::detail::from(total),
                                    torch::stable::detail::from(std::nullopt)};
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("packcuda::segment_positions", "", stack.data(), TORCH_ABI_VERSION));
  torch::stable::Tensor out = torch::stable::detail::to<torch::stable::Tensor>(stack[0]);
  check(out.numel() == total && std::memcmp(out.const_data_ptr(), pos.data(), total * sizeof(int64_t)) == 0,
        "dispatcher: packcuda::segment_positions == core");

  // 3. core API: a zigzag shard plan (cp = 2) of the batch; each original token lands on exactly one rank,
  //    at the padded position it had in its sequence.
  const int64_t cp = 2, align = 2 * cp;
  std::vector<int> seen(total, 0);
  bool pos_ok = true;
  for (int64_t rank = 0; rank < cp; ++rank) {
    packcuda::shard::HostLayout L =
        packcuda::shard::build_layout(cu.data(), nseg, cp, rank, packcuda::shard::kZigzag, align, /*bucket=*/1);
    const int64_t npieces = static_cast<int64_t>(L.piece_seq.size());
    // the per-slot tables read the layout as int32 (every value fits once the padded total does)
    const auto i32 = [](const std::vector<int64_t>& v) { return std::vector<int32_t>(v.begin(), v.end()); };
    const std::vector<int32_t> cu32 = i32(cu), pieces = i32(L.pieces), offset = i32(L.piece_offset),
                               seq = i32(L.piece_seq);
    std::vector<int64_t> index(L.total_local), position(L.total_local), label(L.total_local), offset64(npieces);
    packcuda::shard::PlanTables t;
    t.cu = cu32.data();
    t.nseq = nseg;
    t.pieces = pieces.data();
    t.piece_offset = offset.data();
    t.piece_seq = seq.data();
    t.npieces = npieces;
    t.total_local = L.total_local;
    t.index = index.data();
    t.position = position.data();
    t.label_index = label.data();
    t.piece_offset_wide = offset64.data();
    packcuda::shard::plan_tables_cpu(t);
    for (int64_t s = 0; s < L.total_local; ++s) {
      if (index[s] < 0) continue;
      seen[index[s]] += 1;
      pos_ok &= position[s] == pos[index[s]];
    }
    std::printf("    rank %lld: %lld local slots, %lld pieces\n", static_cast<long long>(rank),
                static_cast<long long>(L.total_local), static_cast<long long>(npieces));
  }
  bool once = true;
  for (int v : seen) once &= v == 1;
  check(once, "core: zigzag shard plan holds every token exactly once across ranks");
  check(pos_ok, "core: shard plan positions == per-sequence positions");

  // 4. core API: Qwen2-VL mRoPE positions of a packed multimodal stream (two samples; the first holds one image
  //    of grid [1, 4, 4], i.e. 4 tokens after the 2x2 spatial merge).
  {
    const int64_t IMG = 151655;
    const std::vector<int64_t> ids = {7, 8, IMG, IMG, IMG, IMG, 9, /* sample 2 */ 5, 6, 7};
    const std::vector<int64_t> mcu = {0, 7, 10};
    const int64_t T = static_cast<int64_t>(ids.size());
    const packcuda::rope::MRopeGrid image{1, 4, 4};
    packcuda::rope::MRopeBlockTable table = packcuda::rope::build_mrope_block_table(
        {}, &image, 1, nullptr, 0, nullptr, /*merge=*/2, /*tokens_per_second=*/nullptr, /*per_frame=*/false,
        /*text_after_max=*/false);
    const packcuda::rope::MRopeTables tb = table.tables(table.table.data(), mcu.data(), 2, IMG, /*video*/ IMG + 1);
    std::vector<int64_t> mpos(3 * T), text_pos(T), deltas(2);
    const int64_t key =
        packcuda::rope::mrope_pos_cpu(mpos.data(), text_pos.data(), deltas.data(), ids.data(), 8, T, tb);
    // t, h, w rows: text counts up; the image block at s = 2 is (2, 2 + hi, 2 + wi); text resumes at s + 2
    const std::vector<int64_t> want_t = {0, 1, 2, 2, 2, 2, 4, 0, 1, 2};
    const std::vector<int64_t> want_h = {0, 1, 2, 2, 3, 3, 4, 0, 1, 2};
    const std::vector<int64_t> want_w = {0, 1, 2, 3, 2, 3, 4, 0, 1, 2};
    bool mok = key == packcuda::rope::kMRopeOk;
    for (int64_t t = 0; t < T; ++t)
      mok &= mpos[t] == want_t[t] && mpos[T + t] == want_h[t] && mpos[2 * T + t] == want_w[t];
    mok &= deltas[0] == 5 - 7 && deltas[1] == 0;
    check(mok, "core: mRoPE positions of a packed image + text stream");
  }

  std::printf("%s\n", failures ? "FAILED" : "all checks passed");
  return failures ? 1 : 0;
}
