//! The form in which the reflectors keep sources and copies: each object as its compact JSON
//! text, with the identity fields (name, namespace, UID, resourceVersion) parsed out.
//!
//! A [`DynamicObject`] held as a `serde_json::Value` tree costs about 7 KB of heap for a 1.2 KB
//! NetworkInterface (every key and string its own allocation, plus map nodes); the same object
//! as text costs about 1.5 KB. With a cache of sources and one of copies per kind, that is what
//! decides the replicator's memory at scale (issue #5: peak RSS at most 100 MB with 10,000
//! objects; measured with `replicator-bench memory`). The caches are read one key at a time
//! (planning one source, judging one copy), so parsing on read (about 10 µs) is small next to
//! the hub round trip it may save.
//!
//! The stores are kube-runtime's reflector [`Store`](kube::runtime::reflector::Store)s; only
//! the stored type is ours ([`Cached`] implements [`Lookup`] with no dynamic type: each store
//! holds one kind, so its keys need none).

use std::borrow::Cow;

use kube::{
    ResourceExt as _,
    api::DynamicObject,
    runtime::{
        reflector::{Lookup, ObjectRef},
        watcher::Event,
    },
};

/// One object of a reflector cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cached {
    name: Box<str>,
    namespace: Option<Box<str>>,
    uid: Option<Box<str>>,
    resource_version: Option<Box<str>>,
    /// The whole object (managedFields cleared by the watch), compact JSON.
    json: Box<str>,
}

impl Cached {
    /// The cached form of `object`.
    ///
    /// Serializing a `DynamicObject` cannot fail (its maps have string keys); were it ever to,
    /// the text is left empty and [`Cached::object`] reports the error when the object is read,
    /// so the key fails visibly (Event, metric) instead of vanishing.
    pub fn new(object: &DynamicObject) -> Cached {
        Cached {
            name: object.name_any().into_boxed_str(),
            namespace: object.metadata.namespace.as_deref().map(Into::into),
            uid: object.metadata.uid.as_deref().map(Into::into),
            resource_version: object.metadata.resource_version.as_deref().map(Into::into),
            json: serde_json::to_string(object).unwrap_or_default().into_boxed_str(),
        }
    }

    /// `metadata.name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `metadata.namespace` (`None` for cluster-scoped objects).
    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }

    /// `metadata.uid`.
    pub fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    /// `metadata.resourceVersion`.
    pub fn resource_version(&self) -> Option<&str> {
        self.resource_version.as_deref()
    }

    /// The object, parsed from its text.
    ///
    /// # Errors
    /// Only if the text is not the object it was made from (see [`Cached::new`]).
    pub fn object(&self) -> Result<DynamicObject, serde_json::Error> {
        serde_json::from_str(&self.json)
    }

    /// Bytes of text held (the object's compact JSON).
    pub fn text_len(&self) -> usize {
        self.json.len()
    }
}

impl Lookup for Cached {
    /// None: a store holds one kind, so the key is namespace and name alone.
    type DynamicType = ();

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }

    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }

    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }

    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }

    fn name(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(&self.name))
    }

    fn namespace(&self) -> Option<Cow<'_, str>> {
        self.namespace.as_deref().map(Cow::Borrowed)
    }

    fn resource_version(&self) -> Option<Cow<'_, str>> {
        self.resource_version.as_deref().map(Cow::Borrowed)
    }

    fn uid(&self) -> Option<Cow<'_, str>> {
        self.uid.as_deref().map(Cow::Borrowed)
    }
}

/// The cache key of `namespace/name`.
pub fn key(namespace: &str, name: &str) -> ObjectRef<Cached> {
    ObjectRef::new(name).within(namespace)
}

/// The watch event `event` with its object in cached form, for the reflector's writer.
pub fn event(event: &Event<DynamicObject>) -> Event<Cached> {
    match event {
        Event::Apply(o) => Event::Apply(Cached::new(o)),
        Event::Delete(o) => Event::Delete(Cached::new(o)),
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(Cached::new(o)),
        Event::InitDone => Event::InitDone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::reflector::store::Writer;
    use serde_json::json;

    fn interface(name: &str, rv: &str) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "networking.datumapis.com/v1alpha",
            "kind": "NetworkInterface",
            "metadata": {
                "name": name, "namespace": "ns-1", "uid": format!("uid-{name}"), "resourceVersion": rv,
                "labels": {"networking.datumapis.com/held-by": name},
                "annotations": {"replicator.datumapis.com/source-name": name},
            },
            "spec": {"interfaceName": "eth0", "mtu": 1460, "addresses": [{"address": "fd20::10/64", "primary": true}]},
            "status": {"conditions": []},
        }))
        .unwrap()
    }

    #[test]
    fn keeps_identity_and_gives_back_the_same_object() {
        let source = interface("ni-1", "17");
        let cached = Cached::new(&source);
        assert_eq!(cached.name(), "ni-1");
        assert_eq!(cached.namespace(), Some("ns-1"));
        assert_eq!(cached.uid(), Some("uid-ni-1"));
        assert_eq!(cached.resource_version(), Some("17"));
        assert_eq!(cached.object().unwrap(), source);
        assert_eq!(cached.text_len(), serde_json::to_string(&source).unwrap().len());
    }

    #[test]
    fn a_reflector_store_of_cached_objects_follows_watch_events() {
        let mut writer = Writer::<Cached>::new(());
        let store = writer.as_reader();
        for e in [
            Event::Init,
            Event::InitApply(interface("ni-1", "1")),
            Event::InitApply(interface("ni-2", "2")),
            Event::InitDone,
        ] {
            writer.apply_watcher_event(&event(&e));
        }
        assert_eq!(store.len(), 2);
        writer.apply_watcher_event(&event(&Event::Apply(interface("ni-1", "3"))));
        let got = store.get(&key("ns-1", "ni-1")).unwrap();
        assert_eq!(got.resource_version(), Some("3"));
        assert_eq!(got.object().unwrap().metadata.resource_version.as_deref(), Some("3"));
        writer.apply_watcher_event(&event(&Event::Delete(interface("ni-2", "4"))));
        assert!(store.get(&key("ns-1", "ni-2")).is_none());
        assert!(
            store.get(&key("other", "ni-1")).is_none(),
            "the namespace is part of the key"
        );
    }

    #[test]
    fn a_damaged_text_is_an_error_on_read_not_a_panic() {
        let mut cached = Cached::new(&interface("ni-1", "1"));
        cached.json = "{".into();
        assert!(cached.object().is_err());
    }
}
