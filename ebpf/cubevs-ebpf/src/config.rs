//! The load-time `CONFIG` global (`cubevs_common::DatapathConfig`), written by userspace.

use cubevs_common::DatapathConfig;

/// Rewritten by the loader (`EbpfLoader::set_global("CONFIG", …)`); read with a volatile load
/// so the compiler cannot constant-fold the defaults.
#[unsafe(no_mangle)]
static CONFIG: DatapathConfig = DatapathConfig::DEFAULT;

/// The datapath configuration in force for this load.
#[inline(always)]
pub fn get() -> DatapathConfig {
    // SAFETY: CONFIG is a plain-old-data static living in .rodata; a volatile read of it is
    // always valid.
    unsafe { core::ptr::read_volatile(&CONFIG) }
}
