#include "shardtrain/core/dtype.h"

#include "shardtrain/core/error.h"

namespace shardtrain {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
    case DType::U8:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::U8:
      return "u8";
  }
  return "?";
}

DType dtype_from_name(std::string_view n) {
  if (n == "f32" || n == "fp32" || n == "float32" || n == "F32") return DType::F32;
  if (n == "bf16" || n == "bfloat16" || n == "BF16") return DType::BF16;
  if (n == "f16" || n == "fp16" || n == "float16" || n == "F16") return DType::F16;
  if (n == "i32" || n == "int32" || n == "I32") return DType::I32;
  if (n == "i64" || n == "int64" || n == "I64") return DType::I64;
  if (n == "u8" || n == "uint8" || n == "U8") return DType::U8;
  throw ConfigError(detail::concat("unknown dtype '", n,
                                   "': expected one of fp32, bf16, fp16, int32, int64, uint8"));
}

bool is_floating(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}

}  // namespace shardtrain
