#include "segment.h"

#include <sys/mman.h>

#include <cctype>
#include <cstring>

namespace ferry::bench {

bool parse_seg_type(const std::string& s, SegType* out) {
  std::string u;
  for (char c : s) u += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (u == "DRAM") *out = SegType::DRAM;
  else if (u == "VRAM") *out = SegType::VRAM;
  else return false;
  return true;
}

const char* to_string(SegType t) { return t == SegType::VRAM ? "VRAM" : "DRAM"; }

Segment::~Segment() {
  if (data_ != nullptr && type_ == SegType::DRAM) ::munmap(data_, size_);
}

namespace {

// GPU memory for a VRAM segment. The ferry core's GPU runtime shim
// (core/src/gpu_runtime.h) is internal and has no device allocation call, and
// ferry.hpp exports no GPU allocator yet, so there is nothing to allocate with.
// When the core offers one, call it here (and free it in ~Segment).
uint8_t* gpu_allocate(int device, size_t bytes, std::string* why) {
  (void)bytes;
  *why = "VRAM segment on device " + std::to_string(device) +
         ": this ferry build offers no GPU memory allocation (ferry.hpp has no GPU "
         "allocator yet); run with DRAM segments";
  return nullptr;
}

}  // namespace

std::unique_ptr<Segment> Segment::allocate(SegType type, int device, size_t bytes,
                                           std::string* why) {
  auto s = std::make_unique<Segment>();
  s->type_ = type;
  s->size_ = bytes;
  if (bytes == 0) {
    *why = "segment of 0 bytes";
    return nullptr;
  }
  if (type == SegType::VRAM) {
    if (device < 0) {
      *why = "VRAM segment needs a device id >= 0";
      return nullptr;
    }
    s->device_ = device;
    s->data_ = gpu_allocate(device, bytes, why);
    if (s->data_ == nullptr) return nullptr;
    return s;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    *why = "cannot map " + std::to_string(bytes) + " bytes of host memory: " + std::strerror(errno);
    return nullptr;
  }
  s->data_ = static_cast<uint8_t*>(p);
  std::memset(s->data_, 0, bytes);  // fault every page in now, not inside a timed transfer
  return s;
}

}  // namespace ferry::bench
