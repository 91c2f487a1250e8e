/* torch 2.14 symbols that sgl-deep-gemm 0.2.5's _C.so needs, provided from the GPU machine's torch 2.11
   (scripts/deepgemm_probe.py --shim compiles it and loads it RTLD_GLOBAL before importing deep_gemm). */
extern const float *_ZNK2at10TensorBase14const_data_ptrIfLi0EEEPKT_v(const void *self);
extern void _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb(int, const char *, const char *, unsigned, _Bool);
const float *_ZNK2at10TensorBase14const_data_ptrIfEEPKT_v(const void *self) {
  return _ZNK2at10TensorBase14const_data_ptrIfLi0EEEPKT_v(self);
}
void _ZN3c104cuda19CUDAErrorLogCaptureC1Ev(void *self) { (void)self; } /* an empty class */
/* c10::ValueError's constructor, exported since: its base c10::Error's (the same members; an error path) */
struct SourceLocation { const char *function; const char *file; unsigned line; };
extern void _ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE(
    void *self, struct SourceLocation loc, void *msg);
void _ZN3c1010ValueErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE(
    void *self, struct SourceLocation loc, void *msg) {
  _ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE(self, loc, msg);
}
/* torch::Library::_def's two overloads: at::Tag became torch::headeronly::Tag (the same enum) */
extern void *_ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorIN2at3TagESaIS8_EENS_17_RegisterOrVerifyE(
    void *, void *, void *, const void *, int);
void *_ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorINS_10headeronly3TagESaIS8_EENS_17_RegisterOrVerifyE(
    void *self, void *schema, void *name, const void *tags, int rov) {
  return _ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameERKSt6vectorIN2at3TagESaIS8_EENS_17_RegisterOrVerifyE(
      self, schema, name, tags, rov);
}
extern void *_ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorIN2at3TagESaISB_EE(
    void *, void *, void *, const void *);
void *_ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorINS_10headeronly3TagESaISB_EE(
    void *self, void *name_or_schema, void *fn, const void *tags) {
  return _ZNR5torch7Library4_defEOSt7variantIJN3c1012OperatorNameENS2_14FunctionSchemaEEEONS_11CppFunctionERKSt6vectorIN2at3TagESaISB_EE(
      self, name_or_schema, fn, tags);
}
/* torch 2.13's stable-ABI error text: NULL is what its own fallback for older torch answers */
const char *torch_exception_get_what(void) { return 0; }
const char *torch_exception_get_what_without_backtrace(void) { return 0; }
void _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jbPNS0_19CUDAErrorLogCaptureE(
    int err, const char *file, const char *func, unsigned line, _Bool dev_asserts, void *capture) {
  (void)capture;
  _ZN3c104cuda29c10_cuda_check_implementationEiPKcS2_jb(err, file, func, line, dev_asserts);
}
